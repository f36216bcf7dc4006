"""``vexpert serve`` with block-FP8 experts, end to end on CPU: a block-FP8 checkpoint, and a dense one quantised at load.

A tiny DeepSeek-V3 with a tokenizer, every projection F8_E4M3 with F32 ``weight_scale_inv`` and
``quantization_config`` in config.json, served by the real command with two EP workers (the coordinator's
pool and the slots hold rows of the same format as the ranks' resident experts): greedy completions equal
transformers' ``generate`` over the dequantised weights, with the experts kept FP8 (``--expert-format fp8_block``;
on a GPU node ``auto`` does so) and dequantised at load (``auto`` on CPU ranks, as ``dense``). Until 2026-12-06 a rank read FP8 rows but computed
them as dense ones, and a ``dense`` node gave its ranks FP8 resident rows beside dense slots.

A dense Qwen3-MoE with ``--expert-format fp8_block`` (what vLLM's ``--quantization fp8`` offers): its experts are
quantised as they are read, in 128 × 128 blocks — greedy completions equal ``generate`` over the checkpoint whose
expert weights went through that quantisation and back.

With ``--linear-format fp8_block`` the non-expert linears stay FP8 too (computed from their stored weights and
scales): the same tokens. Both options on a checkpoint without FP8 weights are refused, naming the field.

W8A8 (``--expert-compute w8a8``): the block-FP8 checkpoint's routed experts multiplied against activations
quantised per token and block column (emulated on CPU ranks, the GPU kernel's twin) — greedy completions equal
``generate`` over the dequantised weights with transformers' expert loop quantising its activations alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from runtime_support import stop_process, wait_healthy
from serve_support import block_fp8_copies, build_tiny_checkpoint, load_model, load_tokenizer
from vexpert_runtime.model.expert_format import dequantize_fp8_block, quantize_fp8_block

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("the quick brown fox", "a lazy dog sat on the mat and")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("block-fp8")
    build_tiny_checkpoint(root / "bf16", family="deepseek_v3")
    return block_fp8_copies(root / "bf16", root)


def _generated(dequantised: Path) -> dict[str, list[int]]:
    """transformers' greedy tokens per prompt over the dequantised weights (no EOS stop)."""
    model, tokenizer = load_model(dequantised), load_tokenizer(dequantised)
    return _greedy(model, tokenizer)


def _greedy(model: Any, tokenizer: Any) -> dict[str, list[int]]:
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
        out[prompt] = generated[0, ids.shape[1]:].tolist()
    return out


def _served(checkpoint: Path, tmp_path: Path, *flags: str) -> tuple[dict[str, list[int]], str]:
    """Each prompt's greedy token ids from ``vexpert serve --cpu-workers 2`` (ignore_eos), and the server's log."""
    from vexpert_runtime.ports import free_port

    port, log = free_port(), tmp_path / f"serve{'-'.join(flags)}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vexpert_runtime", "serve", "--model", str(checkpoint), "--cpu-workers", "2",
         "--host", "127.0.0.1", "--port", str(port), "--kv-cache-tokens", "1024", *flags],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 240)
        tokens = {}
        for prompt in PROMPTS:
            body = {"model": checkpoint.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            pieces = answer.json()["choices"][0]["logprobs"]["tokens"]
            tokens[prompt] = [int(piece.removeprefix("token_id:")) for piece in pieces]
    finally:
        stop_process(proc, 60)
    return tokens, log.read_text(errors="replace")


@pytest.mark.parametrize("flags", [("--expert-format", "fp8_block"), (),
                                   ("--expert-format", "fp8_block", "--linear-format", "fp8_block")],
                         ids=["fp8-rows", "auto", "fp8-rows-and-linears"])
def test_a_block_fp8_checkpoint_is_served_with_the_tokens_of_its_dequantised_weights(
        checkpoints: tuple[Path, Path], flags: tuple[str, ...], tmp_path: Path) -> None:
    """FP8 rows where asked for; ``auto`` on CPU ranks keeps dense rows (no CPU kernel reads FP8: each step would
    dequantise every stack — 12× slower on the tiny Qwen3-MoE of cpu_serve_compare.py)."""
    fp8, dequantised = checkpoints
    expected = _generated(dequantised)
    served, log = _served(fp8, tmp_path, *flags)
    assert served == expected, log[-3000:]
    rows = "block-FP8 rows," if len(flags) == 2 else "block-FP8 rows, other linear layers block-FP8," if flags \
        else "dense rows (dequantised at load),"
    assert f"8 experts as {rows}" in log, log[-3000:]
    assert len({t for tokens in expected.values() for t in tokens}) > 3  # the tokens vary


def _experts_through_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A copy of dense checkpoint ``src`` whose routed experts' projections are their block-FP8 quantisation,
    dequantised (float32): what serving ``src`` with FP8 expert rows computes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    for name, weight in tensors.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            tensors[name] = dequantize_fp8_block(*quantize_fp8_block(weight, block), block, torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_dense_checkpoints_experts_quantised_at_load_serve_the_tokens_of_their_fp8_weights(tmp_path: Path) -> None:
    dense = tmp_path / "qwen3"
    build_tiny_checkpoint(dense)
    expected = _generated(_experts_through_fp8(dense, tmp_path / "through-fp8"))
    served, log = _served(dense, tmp_path, "--expert-format", "fp8_block")
    assert served == expected, log[-3000:]
    assert "8 experts as block-FP8 rows (quantised at load)" in log, log[-3000:]


def _w8a8_experts_forward(group: int) -> Any:
    """transformers' DeepseekV3Experts.forward (its per-expert loop) with each expert GEMM's activations quantised
    per token and ``group`` columns and dequantised first: W8A8's numbers."""
    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            if len(token_idx) == 0:
                continue
            state = fp8_activation_round_trip(hidden_states[token_idx], group)
            gate, up = torch.nn.functional.linear(state, self.gate_up_proj[expert]).chunk(2, dim=-1)
            act = fp8_activation_round_trip(self.act_fn(gate) * up, group)
            result = torch.nn.functional.linear(act, self.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, result.to(out.dtype))
        return out

    return forward


def test_w8a8_serves_the_tokens_of_fp8_activations_against_the_fp8_weights(
        checkpoints: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    fp8, dequantised = checkpoints
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    model, tokenizer = load_model(dequantised), load_tokenizer(dequantised)
    w8a16 = _greedy(model, tokenizer)
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3Experts, "forward", _w8a8_experts_forward(block[1]))
    expected = _greedy(model, tokenizer)
    served, log = _served(fp8, tmp_path, "--expert-format", "fp8_block", "--expert-compute", "w8a8")
    assert served == expected != w8a16, log[-3000:]  # W8A8's numbers were served, not W8A16's
    assert "8 experts as block-FP8 rows × FP8 activations (w8a8, emulated)" in log, log[-3000:]
    print(f"greedy tokens W8A8 vs W8A16: {sum(a != b for p in PROMPTS for a, b in zip(expected[p], w8a16[p], strict=True))} "
          f"of {len(PROMPTS) * NEW_TOKENS} differ")


@pytest.mark.parametrize(("flags", "field"), [(("--expert-format", "dense", "--expert-compute", "w8a8"),
                                                "model.expert_compute"),
                                               (("--linear-format", "fp8_block"), "model.linear_format")],
                         ids=["w8a8-on-dense-rows", "fp8-linears-of-a-dense-checkpoint"])
def test_fp8_options_without_fp8_weights_are_refused_naming_the_field(
        checkpoints: tuple[Path, Path], tmp_path: Path, flags: tuple[str, ...], field: str) -> None:
    fp8, dense = checkpoints
    model = dense if field == "model.linear_format" else fp8
    proc = subprocess.run(
        [sys.executable, "-m", "vexpert_runtime", "serve", "--model", str(model), "--cpu-workers", "2", *flags,
         "--port", "0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert field in proc.stderr and "fp8_block" in proc.stderr, proc.stderr[-2000:]
