"""A two-"node" engine on loopback: node 1's ranks started by `tandem serve --node-rank 1`."""

import os
import subprocess
import sys

import pytest

from tandem import LLM, SamplingParams
from tandem.wire import free_port


@pytest.mark.timeout(240)
def test_two_nodes_on_loopback_match_single_process(llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)
    prompts = ["The quick dog", "12 + 7 ="]
    with LLM(llama_dir) as ref:
        expected = ref.generate(prompts, params)
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # on real hosts: the NIC between them
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            llama_dir,
            "--tp",
            "2",
            "--pp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ],
        env=env,
    )
    try:
        with LLM(
            llama_dir,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            nnodes=2,
            master_port=port,
        ) as llm:
            assert len(llm.worker_locations()) == 2  # ranks 0-1 here, 2-3 on node 1
            got = llm.generate(prompts, params)
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
