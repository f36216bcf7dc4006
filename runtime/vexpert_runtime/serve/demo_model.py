"""A small random DeepSeek-V3-shaped MoE checkpoint with a local tokenizer, for ``vexpert serve`` demos and tests.

:func:`ensure_demo_model` writes (once) a directory that ``AutoModelForCausalLM`` and ``AutoTokenizer``
load offline: transformers' own ``DeepseekV3Config`` (MLA attention, a dense first layer, 16 routed
experts top-4 in 4 groups, one shared expert) with seeded random weights stored in bf16, and a
byte-level BPE tokenizer trained here with the ``tokenizers`` library on a built-in text, with a
simple chat template and an end-of-turn EOS. Random weights generate gibberish; the point is the
serving path (tokenizer → step model → EP experts → sampling), not the text.

Everything is deterministic (fixed seed, fixed text), a few MB, and builds in seconds on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

MARKER = "vexpert_demo.json"  # written last: its presence means the directory is complete
DEMO_VERSION = 2
# The router skew of the demo model: a bundled real DeepSeek-V3 load, scaled for sigmoid scores in (0, 1).
REAL_LOAD_PHASE = "decode_in1000out1000"
# EP2 balance of the demo model on its text: 0.50, 0.76, 0.82 per MoE layer (0.999, 0.89, 0.90 without):
# benchmarks/demo_model_balance.py, results/demo_model_balance.txt
REAL_LOAD_STRENGTH = 0.3
SEED = 1234
BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
TOKENIZER_VOCAB = 2048  # BPE target; the model's vocab is what the trainer actually reaches
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The model's shape (DeepSeek-V3 in miniature); MoE layers 1..3, 16 experts → 8 per rank on 2 ranks.
DEMO_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,  # the dense first layer
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "initializer_range": 0.06,  # larger than the usual 0.02, so that routing and tokens vary
    "tie_word_embeddings": False,
}

_TEXT = """\
A mixture of experts model sends every token to a few of its many expert networks. A router scores
the experts for each token and keeps the best ones; their outputs are added with the router's weights.
Expert parallelism spreads the experts over several GPUs: each GPU holds some experts, and the tokens
travel to the GPUs that hold their experts and back again, in two all-to-all exchanges per layer.
Some experts are much more popular than others, so the GPUs that hold them become the bottleneck.
vExpert keeps copies of the hottest experts in spare slots on the other GPUs and splits their tokens
between the copies, so that every GPU has about the same amount of work in every layer.
The attention layers run on every rank for its own requests, with their own key-value cache.
The server answers chat completions the way the OpenAI API does: a list of messages goes in, and the
assistant's reply comes back, all at once or streamed token by token.
Hello! How can I help you today? Please tell me more about what you need.
What is the capital of France? Paris is the capital of France.
Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' "
"""


def ensure_demo_model(directory: str | Path) -> Path:
    """The demo checkpoint in ``directory``, written there first if it is not complete yet.

    Returns the directory (config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json). Built in a sibling temporary directory and renamed into place, so a
    crash or a concurrent builder never leaves a half-written model behind.
    """
    target = Path(directory)
    if _complete(target):
        return target
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tokenizer = _write_tokenizer(staging)
        _write_model(staging, tokenizer)
        (staging / MARKER).write_text(json.dumps({"version": DEMO_VERSION, "seed": SEED}) + "\n")
        if target.exists() and not _complete(target):
            shutil.rmtree(target)  # an incomplete earlier attempt
        try:
            staging.rename(target)
        except OSError:
            if not _complete(target):  # not a concurrent builder that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _complete(directory: Path) -> bool:
    marker = directory / MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("version") == DEMO_VERSION)
    except (json.JSONDecodeError, OSError):
        return False


def _write_tokenizer(directory: Path) -> Any:
    """Train a byte-level BPE tokenizer on the built-in text; write tokenizer.json and
    tokenizer_config.json (chat template, BOS/EOS/PAD). Returns the ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TEXT.splitlines(), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def real_load_bias(num_layers: int, num_experts: int, phase: str = REAL_LOAD_PHASE,
                   strength: float = REAL_LOAD_STRENGTH) -> Any:
    """[L, E] float32 router correction biases ``strength · (log p − mean)`` from a bundled real
    DeepSeek-V3 load ``p`` (SGLang's expert statistics, evenly subsampled to L layers, E experts):
    random router weights route uniformly, this makes the hot experts hot, so balance moves."""
    import numpy as np

    from vexpert_runtime.simulation.trace import load_bundled_distribution
    from vexpert_runtime.simulation.workload import subsample_distribution

    logp = np.log(subsample_distribution(load_bundled_distribution(phase), num_layers, num_experts))
    return (strength * (logp - logp.mean(1, keepdims=True))).astype(np.float32)


def _write_model(directory: Path, tokenizer: Any) -> None:
    """Seeded random DeepSeek-V3 weights (bf16) sized to the tokenizer's vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, PAD)}
    config = DeepseekV3Config(**DEMO_CONFIG, vocab_size=tokenizer.get_vocab_size(), bos_token_id=ids[BOS],
                              eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    with torch.random.fork_rng(devices=[]):  # seed only this build, not the caller's RNG
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        moe = model.model.layers[config.first_k_dense_replace:]
        skew = real_load_bias(len(moe), config.n_routed_experts)
        for layer, bias in zip(moe, skew, strict=True):
            # The noaux_tc correction bias (which a trained DeepSeek-V3 has) replays a real load's skew.
            layer.mlp.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    model.to(torch.bfloat16).save_pretrained(str(directory))
