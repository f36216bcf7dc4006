"""``--kv-cache-dtype fp8`` (vLLM's option): the paged KV cache in FP8 (e4m3, or e5m2) — half a bf16 cache's bytes,
twice its tokens in the same memory. Rows are stored unscaled and saturated (:func:`~vexpert_runtime.serve.kv_cache.
write_rows`); the model with an FP8 cache computes exactly what it computes over a cache of its own dtype holding the
same rows rounded to FP8 (nothing else changes), for DeepSeek-V3 (MLA latent rows), Qwen3-MoE and Qwen2-MoE (GQA keys
and values), with chunked prompts and sequences joining and leaving. The Triton kernels over an FP8 cache:
tests/test_attention_kernels.py (interpreter) and tests/test_serve_gpu.py (graphed == eager on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_serve_model import CHUNK, JOINS, NEW_TOKENS, PROMPTS, _write, drive
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve import attention_layers
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.kv_cache import KVLayout, kv_cache_dtype, num_blocks_for_memory, write_rows

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def test_fp8_rows_are_rounded_and_saturated_not_nan() -> None:
    rows = torch.tensor([[0.1, -3.3, 1000.0, -1e6], [447.0, 2.0**-9, 0.0, 1e-3]])
    for name, dtype in FP8.items():
        cache = torch.zeros(5, 4, dtype=dtype)
        write_rows(cache, torch.tensor([3, 1]), rows)
        largest = torch.finfo(dtype).max
        back = cache.float()
        assert torch.isfinite(back).all(), name
        assert back[3, 2] == torch.tensor(min(1000.0, largest)).to(dtype).float() and back[3, 3] == -largest  # not NaN
        assert torch.equal(back[3], rows[0].clamp(-largest, largest).to(dtype).float())  # rounded as a cast rounds
        assert (back[3, :2] - rows[0, :2]).abs().max() <= 0.25 * rows[0, :2].abs().max()
        assert torch.equal(back[[0, 2, 4]], torch.zeros(3, 4))  # only the given slots
    cache = torch.zeros(5, 4)
    write_rows(cache, torch.tensor([3, 1]), rows)  # a cache of the compute dtype: the rows as they are
    assert torch.equal(cache[[3, 1]], rows)


def test_the_names_are_vllms_and_fp8_holds_twice_bf16s_tokens() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert all(kv_cache_dtype(name, torch.bfloat16) is dtype for name, dtype in FP8.items())
    with pytest.raises(VExpertInputError, match="kv_cache_dtype"):
        kv_cache_dtype("int8", torch.bfloat16)
    mla = KVLayout(num_layers=61, mla=True, latent=512, rope=64)
    assert mla.token_bytes(torch.float8_e4m3fn) * 2 == mla.token_bytes(torch.bfloat16) == 61 * 576 * 2
    gib = 2**30  # whole blocks: one GiB holds 954 bf16 blocks of DeepSeek-V3's 61 layers, 1,909 FP8 ones
    assert num_blocks_for_memory(gib, mla, 16, torch.float8_e4m3fn) // 2 == num_blocks_for_memory(gib, mla, 16,
                                                                                                   torch.bfloat16)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_a_model_over_an_fp8_cache_computes_what_it_does_over_the_rows_rounded_to_fp8(
        family: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(family, tmp_path / family)
    fp8 = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=512, kv_cache_dtype=name)
    assert fp8.kv_cache is not None and all(layer.dtype is FP8[name] for layer in fp8.kv_cache.layers)
    got = drive(fp8, PROMPTS, NEW_TOKENS, JOINS, CHUNK)
    full = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=512)
    assert full.kv_cache is not None and fp8.kv_cache.bytes * 4 == full.kv_cache.bytes  # float32 → 1 byte
    assert fp8.kv_bytes_per_token() * 4 == full.kv_bytes_per_token()
    exact = drive(full, PROMPTS, NEW_TOKENS, JOINS, CHUNK)

    def rounded(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        largest = torch.finfo(FP8[name]).max
        cache.index_copy_(0, slots, rows.clamp(-largest, largest).to(FP8[name]).to(cache.dtype))

    monkeypatch.setattr(attention_layers, "write_rows", rounded)  # the reference: float32 rows, FP8 values
    reference = drive(HFStepModel(path, dtype=torch.float32, kv_cache_tokens=512), PROMPTS, NEW_TOKENS, JOINS, CHUNK)
    assert got == reference
    assert [len(tokens) for tokens in got] == list(NEW_TOKENS)
    del exact  # (a random model's greedy tokens may differ at near-ties: FP8 rows are not the float32 rows)


def test_the_flag_and_the_config_field_take_vllms_names_and_refuse_others(capsys: pytest.CaptureFixture[str]) -> None:
    from vexpert_runtime.cli import build_parser
    from vexpert_runtime.config import RuntimeConfig, parse_runtime_config

    assert build_parser().parse_args(["serve"]).kv_cache_dtype is None  # unset: the config decides
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    assert RuntimeConfig().runtime.kv_cache_dtype == "auto"
    assert parse_runtime_config({"runtime": {"kv_cache_dtype": "fp8"}}).runtime.kv_cache_dtype == "fp8"
    with pytest.raises(VExpertInputError, match="kv_cache_dtype"):
        parse_runtime_config({"runtime": {"kv_cache_dtype": "fp4"}})


def test_vexpert_serve_with_an_fp8_cache_serves_from_half_the_bytes(tmp_path: Path) -> None:
    """``vexpert serve --kv-cache-dtype fp8`` on 2 CPU ranks (a float32 model: the cache's rows are a quarter of
    their float32 bytes): the start line says so, ``/metrics`` counts the FP8 cache's bytes, and a request is served
    (beside it, ``--return-tokens-as-token-ids``: the server's default for vLLM's request field)."""
    import json
    import re
    import signal
    import urllib.request

    from transformers import AutoConfig

    from serve_process import start_cpu_serve
    from vexpert_runtime.serve.attention_layers import kv_layout

    proc, url, log = start_cpu_serve(tmp_path, "--kv-cache-dtype", "fp8", "--return-tokens-as-token-ids")
    try:
        body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                "logprobs": 1}
        for as_ids in (None, False):
            request = urllib.request.Request(url + "/v1/completions", json.dumps(
                {**body, "return_tokens_as_token_ids": as_ids}).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                answer = json.loads(resp.read())
            assert answer["usage"]["completion_tokens"] == 8
            named = [token.startswith("token_id:") for token in answer["choices"][0]["logprobs"]["tokens"]]
            assert named == [as_ids is None] * 8
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        blocks = float(re.search(r"^vexpert_serve_kv_cache_blocks (\S+)$", metrics, re.MULTILINE).group(1))  # type: ignore[union-attr]
        cached = float(re.search(r"^vexpert_serve_kv_cache_bytes (\S+)$", metrics, re.MULTILINE).group(1))  # type: ignore[union-attr]
        layout = kv_layout(AutoConfig.from_pretrained(str(tmp_path / "ckpt"), local_files_only=True))
        # (the gauge counts the blocks sequences may take; each of the 2 ranks also holds its scratch block)
        assert blocks > 0 and cached == (blocks + 2) * 16 * layout.token_bytes(torch.float8_e4m3fn)
        assert "KV cache in fp8" in log.read_text()
        # named as `vexpert serve PATH`; the compute dtype said
        assert f"serving {tmp_path / 'ckpt'} as 'tiny' on 127.0.0.1:{url.rsplit(':', 1)[1]}: 2 cpu ranks in float32" \
            in log.read_text()
        assert re.search(r"ready for requests: 2 ranks loaded [0-9.]+ s after the node's start", log.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
