"""`LLM.score`: the next-token distribution at every prompt position, computed by the engine's
ranks on the weights being served, against transformers (float32, within 1e-4), in one
process, at TP=2 (vocab-parallel head: full rows), PP=2 (the last stage computes) and on a
fleet of two; running requests are not disturbed; bad input is refused naming the field."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine import model_runner
from tandem.engine.admission import RequestError
from tandem.engine.executor import EngineDeadError
from tandem.engine.messages import CONTROL, ScoreMessage, ScoreResult
from tandem.engine.multiproc import gather_score

pytestmark = pytest.mark.timeout(300)

PROMPT_LENGTHS = [1, 5, 17, 40]


@pytest.fixture(scope="module")
def reference(llama_dir):
    """(transformers' model, prompts, its logits for each prompt)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ref.eval()
    gen = torch.Generator().manual_seed(3)
    vocab = ref.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    with torch.no_grad():
        logits = [ref(torch.tensor([ids])).logits[0].float() for ids in prompts]
    return ref, prompts, logits


def _check(llm: LLM, reference) -> None:
    _, prompts, logits = reference
    logprobs = llm.score(prompts)
    raw = llm.score(prompts, logprobs=False)
    for ids, want, lp, lg in zip(prompts, logits, logprobs, raw, strict=True):
        assert lp.dtype == lg.dtype == torch.float32
        assert lp.shape == lg.shape == (len(ids), want.shape[-1])
        assert (lp - torch.log_softmax(want, dim=-1)).abs().max().item() <= 1e-4
        assert (lg - want).abs().max().item() <= 1e-4


# small batch budgets: the prompts run in several score batches, the longest alone
PARALLEL = {
    "tp2": dict(tensor_parallel_size=2, max_num_seqs=8, max_num_batched_tokens=24),
    "pp2": dict(pipeline_parallel_size=2),
    "dp2": dict(data_parallel_size=2),
}


def test_in_process_matches_transformers(llama_dir, reference, monkeypatch):
    with LLM(llama_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=24) as llm:
        before = llm.engine.stats()
        _check(llm, reference)
        after = llm.engine.stats()
        # two calls of 4 prompts (1 + 5 + 17 tokens, then 40 alone), no generation step
        assert (
            after.score_batches - before.score_batches,
            after.score_prompts - before.score_prompts,
        ) == (4, 8)
        assert after.steps == before.steps and after.kv_blocks_used == 0
        # rows come in pieces of at most SCORE_FRAME_BYTES (3 rows of the 512-token vocab here)
        monkeypatch.setattr(model_runner, "SCORE_FRAME_BYTES", 3 * 4 * 512)
        _check(llm, reference)
        text = llm.score("The quick dog")[0]
        ids = llm.get_tokenizer().encode("The quick dog")
        assert torch.equal(text, llm.score([ids])[0])


@pytest.mark.parametrize("options", list(PARALLEL.values()), ids=list(PARALLEL))
def test_parallel_engines_match_transformers(llama_dir, reference, options):
    with LLM(llama_dir, dtype="float32", **options) as llm:
        _check(llm, reference)


def _generate_and_score(llm: LLM, reference, scoring: bool):
    """A batch of seeded and greedy requests run on a thread; with ``scoring``, the prompts are
    scored again and again until it finishes. (its outputs, the scores taken meanwhile)"""
    _, prompts, _ = reference
    params = [
        SamplingParams(max_tokens=48, temperature=0.8, seed=i, logprobs=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[0] = SamplingParams(max_tokens=48, temperature=0, logprobs=0, ignore_eos=True)
    outs, scores = [], []
    llm.reset_prefix_cache()  # both runs compute their prompts whole
    thread = threading.Thread(target=lambda: outs.extend(llm.generate(prompts, params)))
    thread.start()
    while scoring and thread.is_alive():
        scores.append(llm.score(prompts[1:3]))
    thread.join()
    return outs, scores


@pytest.mark.parametrize("options", [{}, {"tensor_parallel_size": 2}], ids=["one", "tp2"])
def test_scoring_while_requests_run_leaves_them_undisturbed(llama_dir, reference, options):
    _, _, logits = reference
    with LLM(llama_dir, dtype="float32", **options) as llm:
        want, _ = _generate_and_score(llm, reference, scoring=False)
        got, scores = _generate_and_score(llm, reference, scoring=True)
    assert scores  # it did score while the requests ran
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-6)
    for rows in scores:  # and every score is right
        for row, expected in zip(rows, logits[1:3], strict=True):
            assert (row - torch.log_softmax(expected, -1)).abs().max().item() <= 1e-4


def test_bad_input_is_refused_naming_the_field(llama_dir):
    with LLM(llama_dir, dtype="float32", max_model_len=64) as llm:
        vocab = llm.engine.spec.vocab_size
        cases = {
            "prompt 1: prompt is empty": [[1, 2], []],
            f"prompt 0: prompt has token ids outside \\[0, {vocab}\\): \\[{vocab}\\]": [[3, vocab]],
            "prompt 0: prompt has token ids outside .*\\[-1\\]": [[-1, 4]],
            "prompt 1: prompt has 65 tokens; max_model_len is 64": [[1], [2] * 65],
        }
        for message, prompts in cases.items():
            with pytest.raises(RequestError, match=message) as err:
                llm.score(prompts)
            assert err.value.field == "prompt"
        with pytest.raises(ValueError, match="prompts is empty"):
            llm.score([])
        assert llm.score([[1, 2]])[0].shape == (2, vocab)  # the engine still serves
    with LLM(llama_dir, dtype="float32", task="embed") as embedder:
        with pytest.raises(ValueError, match="score needs LLM\\(..., task='generate'\\)"):
            embedder.score([[1, 2]])


def _parts(msg: ScoreMessage, rows: torch.Tensor, per_part: int) -> list[ScoreResult]:
    """``rows`` as a worker sends them, through the codec."""
    parts = []
    for first in range(0, len(rows), per_part):
        piece = rows[first : first + per_part]
        part = ScoreResult(
            msg.step_id, first, len(piece), rows.shape[1], piece.numpy().astype("<f4").tobytes()
        )
        parts.append(CONTROL.decode(CONTROL.encode(part)))
    return parts


def test_score_pieces_are_laid_end_to_end_and_checked():
    msg = ScoreMessage(step_id=7, seqs=[[1, 2, 3], [4], [5, 6]], logprobs=True)
    rows = torch.randn(6, 10)
    for per_part in (1, 4, 6):
        assert torch.equal(gather_score(msg, iter(_parts(msg, rows, per_part))), rows)
    parts = _parts(msg, rows, 2)
    for wrong in (parts[1:], [parts[0], parts[2], parts[1]], [parts[0], parts[0], parts[2]]):
        with pytest.raises(EngineDeadError, match="does not continue step 7"):
            gather_score(msg, iter(wrong))
    other = ScoreMessage(step_id=8, seqs=msg.seqs, logprobs=True)
    with pytest.raises(EngineDeadError, match="does not continue step 8 at row 0 of 6"):
        gather_score(other, iter(parts))
