"""The tiny dummy-weight Llama that the CPU harness serves.

A model directory needs only `config.json` and a tokenizer: the server runs with
`--load-format dummy`, so no weights are read (SGLang initialises them randomly;
outputs are meaningless, scheduling and timing are the engine's own). The tokenizer
is a byte-level BPE trained here, deterministically, on a synthetic corpus.

The config writer is pure standard library and runs in the project's process; the
tokenizer is trained by running this very file as a script with the harness venv's
Python, which has the `tokenizers` package (the project itself does not need it).

Token ids: every id in `[0, vocab_size)` is a real token of the tokenizer, so a
replayer may send any of them as `input_ids`; ids 0-2 are the special tokens
`<s>`, `</s>` and `<pad>`, which a replayer should avoid (`FIRST_ORDINARY_ID`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)
CORPUS_SEED = 20260


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dummy Llama; `name` encodes it, so a new shape gets a new directory."""

    num_layers: int = 6
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 4096
    max_position: int = 8192

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"inconsistent head counts in {self}")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be at least 512 (256 bytes + merges + specials)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def name(self) -> str:
        return f"tiny-llama-l{self.num_layers}-h{self.hidden_size}-v{self.vocab_size}"

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size


DEFAULT_SPEC = ModelSpec()


def llama_config(spec: ModelSpec) -> dict:
    """The HuggingFace `config.json` of a Llama with this shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "model_max_length": DEFAULT_SPEC.max_position,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def write_config(model_dir: Path, spec: ModelSpec = DEFAULT_SPEC) -> None:
    """Write `config.json`, `generation_config.json` and `tokenizer_config.json`."""
    model_dir.mkdir(parents=True, exist_ok=True)
    _write_json(model_dir / "config.json", llama_config(spec))
    _write_json(model_dir / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    _write_json(model_dir / "tokenizer_config.json", tokenizer_config())


def create_model_dir(model_dir: Path, python: Path, spec: ModelSpec = DEFAULT_SPEC) -> Path:
    """Write the config and train the tokenizer with `python` (which must have `tokenizers`)."""
    write_config(model_dir, spec)
    env = dict(os.environ, RAYON_NUM_THREADS="1")  # one thread: a deterministic merge order
    cmd = [str(python), str(Path(__file__)), str(model_dir), str(spec.vocab_size)]
    subprocess.run(cmd, check=True, env=env)
    return model_dir


def synthetic_corpus(lines: int = 20000, seed: int = CORPUS_SEED) -> list[str]:
    """Pseudo-words of random syllables: enough distinct pairs for thousands of merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "z", "br", "ch", "st", "tr", "sh", "th", "pl", "gr", "qu"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "oo", "ou"]
    codas = ["", "", "n", "s", "t", "r", "l", "m", "ng", "x", "ck"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 4)))
        for _ in range(6000)
    ]  # fmt: skip
    punctuation = [" ", " ", " ", " ", ", ", ". ", "; ", " 0", " 1", " 42", "\n"]
    return [
        "".join(rng.choice(words) + rng.choice(punctuation) for _ in range(rng.randint(4, 24)))
        for _ in range(lines)
    ]


def train_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE with exactly `vocab_size` tokens (needs `tokenizers`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    tokenizer.save(str(model_dir / "tokenizer.json"))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    # Run by create_model_dir() with the harness Python: train the tokenizer only.
    train_tokenizer(Path(sys.argv[1]), int(sys.argv[2]))
