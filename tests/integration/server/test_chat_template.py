"""Chat templates read from wherever transformers keeps them (``chat_template.jinja``, named
``additional_chat_templates/*.jinja``, the ``tokenizer_config.json`` key, the processor's legacy
``chat_template.json``), in transformers' precedence, rendered as its ``apply_chat_template``
renders them: through the loader, ``LLM.chat`` / ``get_tokenizer()`` and ``tandem serve``."""

import json
import shutil
from pathlib import Path

import pytest
import transformers

from support.serving import Server
from tandem import LLM, SamplingParams
from tandem.engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate

pytestmark = pytest.mark.timeout(300)

# Each exercises what transformers' Jinja environment has and plain Jinja lacks or differs in:
# a non-escaping `tojson`, `{% break %}`, `{% generation %}`, special tokens as variables.
PLAIN = (
    "{% for m in messages %}{% if loop.index > 4 %}{% break %}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
BRIEF = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}A: {{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['role'][0] | upper }}: {{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
OTHER = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ 'go' if add_generation_prompt }}"
CHAT = [
    {"role": "system", "content": 'Be <b>brief</b> & "exact".'},
    {"role": "user", "content": "Hi!", "name": None},  # None-valued keys are dropped
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "user", "content": "(past the break)"},
]


def _save(
    model_dir: str,
    out: Path,
    templates: str | dict,
    *,
    jinja: bool = True,
    config_key=None,
    legacy_json=None,
) -> Path:
    """A copy of ``model_dir`` whose tokenizer transformers saved with ``templates`` (as
    ``chat_template.jinja`` + named files, or into ``tokenizer_config.json`` with
    ``jinja=False``); then ``config_key`` / ``legacy_json`` written beside, as older tools
    left them."""
    shutil.copytree(model_dir, out)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = templates
    tok.save_pretrained(out, save_jinja_files=jinja)
    if config_key is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": config_key})
        )
    if legacy_json is not None:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": legacy_json}))
    return out


LAYOUTS = {
    # name: (templates saved by transformers, save as jinja files, config key, chat_template.json)
    "config key": (PLAIN, False, None, None),
    "config key, named": ({"default": PLAIN, "brief": BRIEF}, False, None, None),
    "chat_template.jinja": (PLAIN, True, None, None),
    "jinja + named files": ({"default": PLAIN, "brief": BRIEF}, True, None, None),
    "jinja + named files over config key": ({"default": PLAIN, "brief": BRIEF}, True, OTHER, None),
    "named files, no default": ({"brief": BRIEF, "other": OTHER}, True, None, None),
    "lone named file": ({"brief": BRIEF}, True, None, None),
    "jinja over config key": (PLAIN, True, OTHER, None),
    "named files over config key": ({"brief": BRIEF}, True, OTHER, None),
    "jinja over chat_template.json": (PLAIN, True, None, OTHER),
    "config key over chat_template.json": (PLAIN, False, None, OTHER),
}


@pytest.fixture(scope="module")
def checkpoints(model_factory, tmp_path_factory) -> dict[str, Path]:
    base, root = model_factory("llama"), tmp_path_factory.mktemp("chat-templates")
    return {
        name: _save(
            base,
            root / name.replace(" ", "_"),
            templates,
            jinja=jinja,
            config_key=key,
            legacy_json=legacy,
        )
        for name, (templates, jinja, key, legacy) in LAYOUTS.items()
    }


def _reference(model_dir, chat, add_generation_prompt=True, **kw) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(checkpoints, layout, add_generation_prompt):
    model_dir = checkpoints[layout]
    template = ChatTemplate(model_dir)
    try:
        want = _reference(model_dir, CHAT, add_generation_prompt)
    except ValueError:  # several templates, none named `default`
        with pytest.raises(NoChatTemplate, match="brief"):
            template.render(CHAT, add_generation_prompt)
        return
    assert template.render(CHAT, add_generation_prompt) == want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["brief", "default", "{{ messages | length }} messages"])
def test_chat_template_argument_names_a_template_or_is_one(checkpoints, layout, name):
    model_dir = checkpoints[layout]
    want = _reference(model_dir, CHAT, chat_template=name)
    assert ChatTemplate(model_dir).render(CHAT, chat_template=name) == want


def test_legacy_processor_file_when_the_tokenizer_has_none(model_factory, tmp_path):
    """``chat_template.json`` (what processors saved before ``chat_template.jinja``):
    ``AutoTokenizer`` skips it, so the reference is its template rendered by transformers."""
    model_dir = _save(model_factory("llama"), tmp_path / "m", None, legacy_json=BRIEF)
    assert not (model_dir / "chat_template.jinja").exists()
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] is None
    want = _reference(model_dir, CHAT, chat_template=BRIEF)
    assert ChatTemplate(model_dir).render(CHAT) == want


def test_no_template_and_refusals_are_value_errors(model_factory, tmp_path):
    bare = ChatTemplate(_save(model_factory("llama"), tmp_path / "m", None))
    with pytest.raises(NoChatTemplate, match="no chat template"):
        bare.render(CHAT)
    assert isinstance(NoChatTemplate("x"), ValueError)
    refusing = "{{ raise_exception('only users may speak') }}"
    with pytest.raises(ChatTemplateError, match="only users may speak"):
        bare.render(CHAT, chat_template=refusing)


@pytest.fixture(scope="module")
def named_model(checkpoints) -> Path:
    """A checkpoint as current transformers saves one: ``chat_template.jinja`` and a named
    template, plus a stale, different template in ``tokenizer_config.json``."""
    return checkpoints["jinja + named files over config key"]


@pytest.fixture(scope="module")
def llm(named_model):
    with LLM(str(named_model), kv_cache_memory=16 << 20) as llm:
        yield llm


GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def test_llm_chat_equals_generate_on_the_rendered_prompt(llm, named_model):
    second = [{"role": "user", "content": "Count to three."}]
    want = llm.generate([_reference(named_model, CHAT), _reference(named_model, second)], GREEDY)
    got = llm.chat([CHAT, second], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    one = llm.chat(second, GREEDY)  # a single conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[1].outputs[0].token_ids


def test_llm_chat_takes_a_template_name_and_no_generation_prompt(llm, named_model):
    text = _reference(named_model, CHAT, add_generation_prompt=False, chat_template="brief")
    got = llm.chat(CHAT, GREEDY, chat_template="brief", add_generation_prompt=False)
    assert got[0].outputs[0].token_ids == llm.generate(text, GREEDY)[0].outputs[0].token_ids


def test_get_tokenizer_applies_the_chat_template_as_transformers(llm, named_model):
    tok = llm.get_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(named_model)
    assert tok is llm.tokenizer
    assert tok.encode("Hello there") == hf.encode("Hello there", add_special_tokens=False)
    assert tok.apply_chat_template(CHAT, tokenize=False) == hf.apply_chat_template(
        CHAT, tokenize=False
    )
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True) == list(
        hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    )


def _prepending_bos(model_dir: Path) -> Path:
    """``model_dir`` with a tokenizer whose post-processor prepends BOS (as Llama 3's)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = json.loads((model_dir / "tokenizer_config.json").read_text())["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(str(model_dir / "tokenizer.json"))
    return model_dir


def test_chat_adds_no_special_tokens_the_template_did_not_write(model_factory, tmp_path):
    """A tokenizer whose post-processor prepends BOS (Llama 3's): the template writes
    ``{{ bos_token }}`` itself, so the chat is encoded without adding it again, offline and
    by the server (vLLM's ``add_special_tokens: false`` for chat)."""
    from tokenizers import Tokenizer

    model_dir = _prepending_bos(_save(model_factory("llama"), tmp_path / "m", BRIEF))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = json.loads((model_dir / "tokenizer_config.json").read_text())["bos_token"]
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = list(hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    assert want.count(tok.token_to_id(bos)) == 1
    with LLM(str(model_dir), kv_cache_memory=16 << 20) as llm:
        got = llm.chat(CHAT, SamplingParams(max_tokens=1))[0]
        assert got.prompt_token_ids == want
        assert got.prompt == hf.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=False
        )
        assert llm.get_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True) == want
    with Server(str(model_dir)) as s:
        body = {"model": s.model, "messages": CHAT, "max_tokens": 1, "return_token_ids": True}
        r = s.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == want


def test_server_renders_a_checkpoint_saved_by_current_transformers(llm, named_model):
    """The issue's case: the template only in ``chat_template.jinja`` (and a stale one in the
    config) -- tandem serve used to answer 400 ``no_chat_template``."""
    hf = transformers.AutoTokenizer.from_pretrained(named_model)
    want_ids = list(hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    want = llm.generate([want_ids], GREEDY)[0].outputs[0]
    with Server(str(named_model)) as s:
        r = s.post(
            "/v1/chat/completions",
            json={
                "model": s.model,
                "messages": CHAT,
                "max_tokens": 5,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == want_ids
        assert choice["token_ids"] == want.token_ids


def test_server_takes_vllms_chat_template_kwargs_and_add_special_tokens(model_factory, tmp_path):
    """vLLM's chat fields: ``chat_template_kwargs`` reach the template as variables (Qwen3's
    ``enable_thinking``), ``add_special_tokens: true`` adds the tokenizer's own on top; a
    kwarg the request's own fields set is refused by name."""
    think = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}A:{% if enable_thinking is defined and not "
        "enable_thinking %} /no_think{% endif %}{% endif %}"
    )
    model_dir = _prepending_bos(_save(model_factory("llama"), tmp_path / "m", think))
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    no_think = hf.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert plain != no_think
    with Server(str(model_dir)) as s:

        def prompt_ids(**extra):
            body = {"model": s.model, "messages": CHAT, "max_tokens": 1, "return_token_ids": True}
            r = s.post("/v1/chat/completions", json=body | extra)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["prompt_token_ids"]

        assert prompt_ids() == hf(plain, add_special_tokens=False)["input_ids"]
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        assert prompt_ids(**kwargs) == hf(no_think, add_special_tokens=False)["input_ids"]
        with_specials = hf(plain, add_special_tokens=True)["input_ids"]
        assert with_specials != hf(plain, add_special_tokens=False)["input_ids"]
        assert prompt_ids(add_special_tokens=True) == with_specials
        reserved = {"model": s.model, "messages": CHAT, "chat_template_kwargs": {"messages": []}}
        r = s.post("/v1/chat/completions", json=reserved)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
