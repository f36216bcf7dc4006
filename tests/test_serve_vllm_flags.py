"""vLLM's engine flags on ``vexpert serve``. The engine seed (``--seed``): requests that bring no seed take theirs
from a stream the seed starts on each rank, so a restarted server sent the same requests in the same order samples the
same tokens; two ranks of one seed draw different streams; a request's own seed wins; without ``--seed`` every
request draws fresh entropy. ``--enforce-eager`` reaches the rank (no CUDA graphs). A vLLM command line's parallelism
(``-dp N -ep --trust-remote-code``) starts N ranks; tensor and pipeline parallelism are refused saying what to pass."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from serve_support import IdText, build_tiny_checkpoint, id_text_tokens
from vexpert_runtime.serve.events import Event, GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.rank import ServeWorkerArgs
from vexpert_runtime.serve.sampling import engine_seeds, request_seed
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig

PROMPT = tuple(range(5, 17))
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-seed")
    build_tiny_checkpoint(directory, "qwen3_moe")
    return directory


def _serve(directory: Path, seed: int | None, rank: int = 0, params: SamplingParams = SAMPLED,
           requests: int = 4) -> list[list[int]]:
    """``requests`` requests of one prompt, submitted in order to a fresh rank (a restarted server); their tokens."""
    model = HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=1024, block_size=4)
    scheduler = Scheduler(model, IdText(), SchedulerConfig(kv_budget_tokens=None, max_running=requests, seed=seed),
                          rank=rank)
    events: list[list[Event]] = [[] for _ in range(requests)]
    for i in range(requests):
        scheduler.submit(GenerationRequest(f"r{i}", PROMPT, params), events[i].append)
    for _ in range(200):
        if not scheduler.has_work():
            break
        scheduler.run_iteration()
    assert not scheduler.has_work()
    tokens = [id_text_tokens("".join(e.text for e in stream)) for stream in events]
    assert all(len(t) == params.max_tokens for t in tokens)
    return tokens


def test_an_engine_seed_repeats_a_restarted_servers_samples_and_differs_per_request_and_rank(checkpoint: Path) -> None:
    first = _serve(checkpoint, seed=7)
    assert _serve(checkpoint, seed=7) == first  # a restart: the same requests in the same order, the same tokens
    assert len({tuple(t) for t in first}) > 1  # one stream, not one seed: identical prompts sample differently
    assert _serve(checkpoint, seed=7, rank=1) != first  # another rank of the same seed: a stream of its own
    assert _serve(checkpoint, seed=8) != first


def test_without_an_engine_seed_requests_draw_fresh_entropy_and_a_requests_own_seed_wins(checkpoint: Path) -> None:
    assert _serve(checkpoint, seed=None, requests=2) != _serve(checkpoint, seed=None, requests=2)
    own = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=3)
    assert _serve(checkpoint, seed=7, params=own, requests=1) == _serve(checkpoint, seed=8, params=own, requests=1) \
        == _serve(checkpoint, seed=None, params=own, requests=1)


def test_request_seed_takes_the_requests_own_then_the_engines_stream() -> None:
    assert request_seed(2**63 + 5, engine_seeds(1, 0)) == 5  # reduced to 63 bits, the stream untouched
    a, b = engine_seeds(1, 0), engine_seeds(1, 0)
    assert a is not None and b is not None
    assert [request_seed(None, a) for _ in range(3)] == [request_seed(None, b) for _ in range(3)]
    assert all(0 <= request_seed(None, a) < 2**63 for _ in range(100))
    assert engine_seeds(None, 0) is None


def test_the_serve_flags_reach_the_rank(tmp_path: Path) -> None:
    """``--seed`` and ``--enforce-eager`` (vLLM's names) reach what each rank is started with: its scheduler's seed
    and the switch the worker reads before it captures CUDA graphs (``graphs_enabled``)."""
    from vexpert_runtime.commands import serve
    from vexpert_runtime.node.step_graph import graphs_enabled

    build_tiny_checkpoint(tmp_path, "qwen3_moe")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())

    def ranks(*flags: str) -> list[ServeWorkerArgs]:
        args = parser.parse_args(["serve", str(tmp_path), "--cpu-workers", "2", *flags])
        served = serve._resolve_served(args, serve._runtime_config(args))
        return [serve.rank_args(served, args, None, [None]) for _ in range(served.setup.local_workers)]

    eager = ranks("--seed", "-3", "--enforce-eager")
    assert len(eager) == 2 and all(r.scheduler.seed == -3 and r.enforce_eager for r in eager)
    assert all(r.scheduler.seed is None and not r.enforce_eager for r in ranks())
    assert not graphs_enabled(enforce_eager=True) and graphs_enabled(enforce_eager=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--seed", "x"])


def test_vllm_parallel_flags_map_to_ranks_or_say_what_to_pass(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM command line (``-dp N --enable-expert-parallel --trust-remote-code``) starts the same layout: N ranks,
    each with a share of the experts; tensor and pipeline parallelism, which vexpert does not have, are one-line
    errors saying what to pass instead."""
    from test_input_errors import run_cli
    from vexpert_runtime.commands import serve

    build_tiny_checkpoint(tmp_path, "qwen3_moe")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())

    def local_ranks(*flags: str) -> int:
        args = parser.parse_args(["serve", str(tmp_path), *flags])
        return serve._resolve_served(args, serve._runtime_config(args)).setup.local_workers

    assert local_ranks("--cpu-workers", "1", "-dp", "1", "-ep", "--trust-remote-code", "-tp", "1") == 1
    capsys.readouterr()  # the checkpoint's progress bars: not the CLI's
    if not torch.cuda.is_available():  # CPU workers: -dp names them as --cpu-workers does
        assert local_ranks("--data-parallel-size", "4", "--enable-expert-parallel") == 4
    for flag in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size"):
        match = run_cli(["serve", str(tmp_path), "--cpu-workers", "1", flag, "8"], capsys)
        assert match["field"] in ("--tensor-parallel-size", "--pipeline-parallel-size")
        assert "--data-parallel-size N" in match["fix"]
    assert run_cli(["serve", str(tmp_path), "--cpu-workers", "2", "-dp", "3"], capsys)["field"] == "--data-parallel-size"
    assert run_cli(["serve", str(tmp_path), "-dp", "0"], capsys)["field"] == "--data-parallel-size"
    config = tmp_path / "runtime.json"  # a config's ranks are its own: -dp must name as many
    config.write_text('{"parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2}, '
                      '"runtime": {"device": "cpu", "cpu_workers": 2}}')
    assert local_ranks("--config", str(config), "-dp", "2") == 2
    mismatch = run_cli(["serve", str(tmp_path), "--config", str(config), "-dp", "4"], capsys)
    assert mismatch["field"] == "--data-parallel-size" and "gpus_per_node" in mismatch["fix"]
    assert run_cli(["serve", str(tmp_path), "--max-log-len", "-1"], capsys)["field"] == "--max-log-len"
    for bad in ("https://app.example", '{"a": 1}', '[""]'):  # vLLM's JSON lists
        assert run_cli(["serve", str(tmp_path), "--allowed-origins", bad], capsys)["field"] == "--allowed-origins"
