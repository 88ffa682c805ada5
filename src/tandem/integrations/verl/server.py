"""One verl rollout replica's server: a named Ray actor that runs a `tandem serve` process and
answers verl's calls (``generate`` token in, token out; ``wake_up``, ``sleep``,
``clear_kv_cache``, ``abort_all_requests``, ``resume_generation``, ...) over its HTTP API.

``generate`` follows verl's vLLM server: ``max_tokens`` from the call, else
``min(response_length, prompt_length + response_length - len(prompt))``, clamped to the
context; log-probs are processed (after temperature and top-k / top-p: verl's
``logprobs_mode="processed_logprobs"``, what its trainer recomputes with logits divided by the
temperature), one per token, when ``sampling_params["logprobs"]`` is set;
``extra_fields["global_steps"]`` is the weight version that generated the tokens (tandem
pushes are versioned by verl's ``global_steps``). verl's routing replay
(``enable_rollout_routing_replay``) wants the experts of every prompt position too; tandem
reports those of the generated tokens only, so it is refused (`TandemReplica`).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

# rollout config -> `tandem serve` flags
_FLAGS = {
    "tensor_model_parallel_size": "--tp",
    "pipeline_model_parallel_size": "--pp",
    "data_parallel_size": "--dp",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "dtype": "--dtype",
    "seed": "--seed",
}


def serve_args(config, model_path: str, host: str, admin_key: str) -> list[str]:
    """The `tandem serve` command line for a verl ``RolloutConfig``; ``engine_kwargs.tandem``
    adds flags of its own (``{"kv_cache_memory": 1 << 30}`` -> ``--kv-cache-memory``)."""
    args = ["--model", model_path, "--host", host, "--admin-key", admin_key,
            "--log-level", "warning"]  # fmt: skip
    for field, flag in _FLAGS.items():
        value = getattr(config, field, None)
        if value is not None:
            args += [flag, str(value)]
    if getattr(config, "enable_prefix_caching", True) is False:
        args.append("--no-enable-prefix-caching")
    extra = (getattr(config, "engine_kwargs", None) or {}).get("tandem") or {}
    for name, value in dict(extra).items():
        args += ["--" + str(name).replace("_", "-"), str(value)]
    return args


def max_tokens(config, prompt_len: int, params: dict, context: int | None) -> int:
    """verl's rule for a call without ``max_tokens``."""
    n = params.get("max_tokens", params.get("max_new_tokens"))
    if n is None:
        n = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    limit = (context or config.prompt_length + config.response_length) - prompt_len
    return max(1, min(int(n), limit))


class TandemServer:
    """Made by `TandemReplica` as the Ray actor ``tandem_server_{replica}_{node}``."""

    def __init__(self, config, model_path: str, replica_rank: int):
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.model_path = model_path
        self.replica_rank = replica_rank
        self.admin_key = secrets.token_hex(16)
        self.process = None
        self.url = ""
        self.model_name = ""
        self.context: int | None = None
        self.global_steps: int | None = None
        self._session = None

    async def launch(self) -> str:
        """Start `tandem serve`; its ``host:port``."""
        import asyncio

        import ray

        from tandem.server.process import ServerProcess

        host = ray.util.get_node_ip_address()
        args = serve_args(self.config, self.model_path, host, self.admin_key)
        self.process = await asyncio.to_thread(ServerProcess, args)
        self.url, self.model_name = self.process.url, self.process.model_name
        models = await self._call("GET", "/v1/models")
        self.context = models["data"][0].get("max_model_len")
        return self.url.removeprefix("http://")

    def connection(self) -> tuple[str, str]:
        """(URL, admin key) for the trainer ranks' weight pushes."""
        return self.url, self.admin_key

    def get_server_address(self) -> str:
        return self.url.removeprefix("http://")

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        **kwargs,
    ):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise ValueError("tandem's verl rollout takes text prompts (token ids) only")
        params = dict(sampling_params)
        want_logprobs = bool(params.get("logprobs"))
        body = {
            "model": self.model_name,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens(self.config, len(prompt_ids), params, self.context),
            "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)),
            "top_k": int(params.get("top_k", -1)),
            "logprobs": 0 if want_logprobs else None,
            "logprobs_mode": "processed",
            "request_id": request_id,
            "ignore_eos": bool(params.get("ignore_eos", self.config.ignore_eos)),
        }
        if params.get("seed") is not None:
            body["seed"] = int(params["seed"])
        if float(params.get("repetition_penalty", 1.0)) != 1.0:  # not offered: never dropped
            raise ValueError(
                "tandem has no repetition_penalty (nor any other penalty); leave "
                "rollout.repetition_penalty at 1.0"
            )
        out = await self._call("POST", "/v1/completions", body, admin=False)
        choice = out["choices"][0]
        logprobs = choice["logprobs"]["token_logprobs"] if want_logprobs else None
        aborted = choice.get("finish_reason") == "abort"
        return TokenOutput(
            token_ids=choice["token_ids"],
            log_probs=logprobs,
            stop_reason="aborted" if aborted else "completed",
            extra_fields={
                "global_steps": out.get("weight_version"),
                "finish_reason": choice.get("finish_reason"),
            },
        )

    async def wake_up(self, tags: list[str] | None = None):
        await self._call("POST", "/wake_up", {"tags": tags} if tags else {})

    async def sleep(self):
        # level 2 frees the weights too: the next push restores them
        level = 2 if self.config.free_cache_engine else 1
        await self._call("POST", "/sleep", {"level": level})

    async def release_kv_cache(self):
        await self._call("POST", "/sleep", {"level": 1})

    async def resume_kv_cache(self):
        await self._call("POST", "/wake_up", {"tags": ["kv_cache"]})

    async def clear_kv_cache(self):
        await self._call("POST", "/reset_prefix_cache")

    async def abort_all_requests(
        self, reset_prefix_cache: bool = True, reject_request: bool = False
    ) -> dict:
        """verl's partial rollout: every running request ends now (its caller gets what was
        generated, stop_reason ``aborted``) and generation stays blocked, new requests held,
        until `resume_generation`. ``reject_request`` (fail new requests instead of holding
        them) is not offered: tandem holds them, as verl allows of backends that cannot."""
        if reject_request:
            import logging

            logging.getLogger(__name__).warning(
                "tandem holds requests that arrive while generation is blocked: "
                "reject_request ignored"
            )
        out = await self._call(
            "POST", "/pause", {"mode": "abort", "clear_cache": reset_prefix_cache}
        )
        return {"aborted_count": out["aborted"], "request_ids": []}

    async def resume_generation(self):
        await self._call("POST", "/resume")

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.process is not None:
            self.process.stop()
            self.process = None

    async def _call(self, method: str, path: str, body: dict | None = None, admin: bool = True):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        headers = {"Authorization": f"Bearer {self.admin_key}"} if admin else {}
        async with self._session.request(
            method, self.url + path, json=body, headers=headers
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise RuntimeError(f"tandem serve {path}: {response.status} {text}")
            return json.loads(text)
