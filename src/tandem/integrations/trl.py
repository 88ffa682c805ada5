"""TRL's ``GRPOTrainer`` with tandem generating: ``rollout_func=TandemRollout(llm)``.

TRL (1.16) calls ``rollout_func(prompts, trainer)`` with the process's generation batch, each
prompt already repeated ``num_generations`` times in a row, and wants one completion per entry:
``{"prompt_ids", "completion_ids", "logprobs"}`` plus extra fields merged per completion. Before
generating, `TandemRollout` pushes the trainer's weights whenever ``trainer.state.global_step``
moved since its last push (version = global_step), so every rollout comes from the policy being
trained; repeated prompts go to the engine as one request with ``n`` samples, which share the
prompt's KV blocks.

PEFT (LoRA): a PEFT policy (``GRPOTrainer(..., peft_config=LoraConfig(...))``, or a model
wrapped by ``get_peft_model``) syncs only its active adapter's A and B tensors, into the
engine's adapter slot ``lora_name`` (default ``"policy"``), and generates with
``LoRARequest(lora_name, 1)``: the adapter's latest version on the base weights the engine
loaded (the same checkpoint as the trainer's base model). The engine must be made with
``enable_lora=True`` and ``max_lora_rank`` >= the adapter's ``r``; its first push (at the first
rollout, version 0) is the adapter as PEFT initialised it.

Log-probs: TRL's importance ratio uses ``log_softmax(logits / args.temperature)``. The rollout
samples at the trainer's temperature by default and asks tandem for processed log-probs (after
temperature), which are exactly that when top-p is 1 and top-k is off; otherwise it warns.
"""

from __future__ import annotations

import warnings
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import LoRAError
from tandem.exchange import PushStats, WeightSender
from tandem.lora.checkpoint import is_peft_model
from tandem.lora.config import AdapterConfig
from tandem.lora.request import LoRARequest

DEFAULT_LORA_NAME = "policy"


class TandemRollout:
    """A TRL ``rollout_func`` backed by a tandem engine.

    ``llm``: a `tandem.LLM` in the trainer process, or the URL of a `tandem serve`
    (``http://host:port``; ``admin_key`` or ``$TANDEM_ADMIN_KEY`` for its weight pushes).
    ``temperature`` defaults to the trainer's ``args.temperature``; ``model_name`` (URL form)
    to the server's one model. ``push=False`` never pushes
    (weights synced some other way); `sync` pushes explicitly. ``sender_options`` go to
    `WeightSender` (transport, mode, keep_versions, ...). ``last_push``: the `PushStats` of
    the latest push.

    A PEFT model pushes only its active LoRA adapter, into the engine's adapter ``lora_name``
    (default ``"policy"``; only for PEFT models), and generates with it; the engine needs
    ``enable_lora=True`` and ``max_lora_rank`` >= the adapter's ``r`` (a `LoRAError` says
    which, before anything is pushed). A ``tandem serve`` URL cannot serve a PEFT policy yet.
    """

    def __init__(
        self,
        llm,
        *,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        push: bool = True,
        admin_key: str | None = None,
        model_name: str | None = None,
        lora_name: str | None = None,
        **sender_options: Any,
    ):
        if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        self.llm = llm
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.push = push
        self.admin_key = admin_key
        self.model_name = model_name
        self.sender_options = sender_options
        self.lora_name = lora_name
        self.version: int | None = None  # the global_step last pushed
        self.pushes = 0
        self.last_push: PushStats | None = None
        self._checked: object | None = None  # the PEFT model last checked against the engine
        self._sender: WeightSender | None = None
        self._client = None
        if top_p < 1.0 or top_k > 0:
            warnings.warn(
                "TandemRollout: with top_p < 1 or top_k > 0 the engine's log-probs (after "
                "top-p/top-k) differ from TRL's log_softmax(logits / temperature)",
                stacklevel=2,
            )

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        step = trainer.state.global_step
        model = _unwrapped(trainer.model, trainer)
        lora = self._lora(model)
        if self.push and step != self.version:
            self.sync(model, step)
        temperature = self.temperature
        if temperature is None:
            temperature = float(getattr(trainer.args, "temperature", 1.0))
        ids = [_tokenize(trainer.processing_class, p) for p in prompts]
        groups = _runs(ids)  # (first entry, count): repeated prompts in a row
        params = [
            SamplingParams(
                n=count,
                max_tokens=self.max_tokens,
                temperature=temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                logprobs=0,
                logprobs_mode="processed",
                seed=None if self.seed is None else self.seed + first,
            )
            for first, count in groups
        ]
        completions = self._generate([ids[first] for first, _ in groups], params, lora)
        out: dict[str, list] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "weight_version": [],
        }
        for (first, count), samples in zip(groups, completions, strict=True):
            if len(samples) != count:
                raise RuntimeError(f"the engine returned {len(samples)} samples, not {count}")
            for token_ids, logprobs, version in samples:
                out["prompt_ids"].append(ids[first])
                out["completion_ids"].append(token_ids)
                out["logprobs"].append(logprobs)
                out["weight_version"].append(version)
        return out

    def sync(self, model, version: int, trainer=None) -> PushStats:
        """Push ``model``'s weights (unwrapped from accelerate) as ``version`` (the
        trainer's global step: versions only go forward, but step 0 is taken whatever the
        engine serves); a PEFT model's: only its active adapter, into adapter
        ``lora_name``."""
        model = _unwrapped(model, trainer)
        lora = self._lora(model)
        if self._sender is None or self._sender.model is not model:
            if self._sender is not None:
                self._sender.close()
            options = dict(self.sender_options)
            if isinstance(self.llm, str):
                options.setdefault("admin_key", self.admin_key)
            if lora is not None:
                options["lora_name"] = lora.lora_name
            self._sender = WeightSender(model, self.llm, **options)
        # step 0 is where a run starts: its weights replace whatever the engine serves (the
        # checkpoint's version 0, or an earlier run's), a rollback in the engine's terms
        self.last_push = self._sender.push(version=version, rollback=version == 0)
        self.version = version
        self.pushes += 1
        return self.last_push

    def _lora(self, model) -> LoRARequest | None:
        """The adapter the rollouts run with (None: the base model, for a plain model); a PEFT
        model is first checked against the engine (LoRA enabled, its rank served)."""
        if not is_peft_model(model):
            if self.lora_name is not None:
                raise ValueError(
                    f"TandemRollout: lora_name={self.lora_name!r} needs a PEFT "
                    f"model; the trainer's is a {type(model).__name__}"
                )
            return None
        name = self.lora_name or DEFAULT_LORA_NAME
        if self._checked is not model:
            self._check_engine(model, name)
            self._checked = model
        return LoRARequest(name, 1)

    def _check_engine(self, model, name: str) -> None:
        """A clear error, before any push, where the engine cannot serve ``model``'s adapter."""
        if isinstance(self.llm, str):
            raise NotImplementedError(
                "TandemRollout: a PEFT model's adapter cannot be served through a tandem serve "
                "URL yet (its completions do not select adapters); pass an in-process "
                "tandem.LLM(..., enable_lora=True)"
            )
        adapter = model.active_adapter
        if not isinstance(adapter, str):
            raise LoRAError(
                f"TandemRollout: the PEFT model has active adapters {adapter}; "
                "set one with set_adapter()"
            )
        rank = AdapterConfig.from_peft(model.peft_config[adapter], f"adapter {adapter!r}").rank
        engine = self.llm.engine
        if engine is None:
            raise RuntimeError("TandemRollout: the LLM has been shut down")
        options = engine.config.lora
        if not options.enable_lora:
            raise LoRAError(
                f"TandemRollout: the trainer's model is a PEFT model (adapter {adapter!r}, "
                f"r={rank}); its adapter is pushed into the engine's adapter {name!r}, so make "
                f"the engine with LLM(..., enable_lora=True, max_lora_rank>={rank})"
            )
        if rank > options.max_lora_rank:
            raise LoRAError(
                f"TandemRollout: the PEFT adapter {adapter!r} has r={rank}, above the engine's "
                f"max_lora_rank={options.max_lora_rank}; make the engine with "
                f"LLM(..., enable_lora=True, max_lora_rank>={rank})"
            )

    def _generate(
        self,
        prompt_ids: list[list[int]],
        params: list[SamplingParams],
        lora: LoRARequest | None = None,
    ) -> list:
        """Per prompt, its samples as (token ids, log-probs, weight version): with ``lora``,
        the version of the adapter they ran with (the latest pushed)."""
        if not isinstance(self.llm, str):
            if lora is None:
                outputs = self.llm.generate(prompt_ids, params)
                return [
                    [(c.token_ids, c.logprobs, o.weight_version) for c in o.outputs]
                    for o in outputs
                ]
            # requests pin the adapter's latest version when queued, in this thread
            latest = {a.name: a.version for a in self.llm.engine.adapters.loaded()}
            version = latest.get(lora.lora_name, -1)
            outputs = self.llm.generate(prompt_ids, params, lora_request=lora)
            return [[(c.token_ids, c.logprobs, version) for c in o.outputs] for o in outputs]
        return [self._complete(ids, p) for ids, p in zip(prompt_ids, params, strict=True)]

    def _complete(self, ids: list[int], p: SamplingParams) -> list:
        """One `/v1/completions` request with token ids in, token ids and log-probs out."""
        import httpx

        if self._client is None:
            url = self.llm if "://" in self.llm else f"http://{self.llm}"
            self._client = httpx.Client(base_url=url.rstrip("/"), timeout=600.0)
        if self.model_name is None:  # the one model the server serves
            self.model_name = self._client.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": self.model_name,
            "prompt": ids,
            "n": p.n,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "logprobs": 0,
            "logprobs_mode": "processed",
        }
        if p.seed is not None:
            body["seed"] = p.seed
        reply = self._client.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"tandem serve answered {reply.status_code}: {reply.text[:500]}")
        data = reply.json()
        version = data.get("weight_version", 0)
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return [(c["token_ids"], c["logprobs"]["token_logprobs"], version) for c in choices]


def _tokenize(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):  # conversational: a list of messages
        return list(
            tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _runs(ids: list[list[int]]) -> list[tuple[int, int]]:
    """(first index, length) of each run of equal consecutive entries."""
    runs: list[tuple[int, int]] = []
    for i, entry in enumerate(ids):
        if runs and ids[runs[-1][0]] == entry:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _unwrapped(model, trainer):
    """The model to push, unwrapped from accelerate (DDP): a plain model, or a PEFT model."""
    if trainer is not None and getattr(trainer, "accelerator", None) is not None:
        model = trainer.accelerator.unwrap_model(model)
    return model
