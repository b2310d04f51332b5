"""What ``flashguard check`` reads from paths: a model, its tokenizer, a text, the batches.

Models: a Hugging Face checkpoint folder (``save_pretrained``: ``config.json``), loaded with
``AutoModelForCausalLM`` and ``attn_implementation="sdpa"`` unless another is asked for; or a
flashguard / nanoGPT-style run (a run folder with ``checkpoints/``: its latest checkpoint; or a
checkpoint file ``.pt``), rebuilt from the configuration stored in the checkpoint, with the
attention it was trained with (``attn="sdpa"``: every layer on torch's SDPA instead).

Tokenizer: the checkpoint's own (a Hugging Face folder with tokenizer files; a flashguard run
whose prepared data names ``gpt2`` and whose BPE files are available offline), else the byte
tokenizer (``flashguard.data.tokenizers.ByteTokenizer``: ids 0-255, in any vocabulary >= 256).
Text: a file, or the embedded corpus (Python's standard library sources, as ``flashguard demo``
prepares it; only as many documents as the batches need).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Loaded", "load_model", "read_text", "encode", "embedded_tokens", "make_batches"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass
class Loaded:
    model: torch.nn.Module
    kind: str                 # "hf" or "flashguard"
    tokenizer: object         # encode(str) -> list[int], or a transformers tokenizer
    tokenizer_name: str
    vocab_size: int
    max_len: int | None       # longest input the model takes (positions)
    name: str


def load_model(path, *, attn: str | None = None, device: str = "cpu") -> Loaded:
    """The model at ``path`` (module docstring); FileNotFoundError / ValueError name the path."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--model {path}: no such file or folder")
    if p.is_dir() and (p / "config.json").is_file():
        return _load_hf(p, attn, device)
    if (p.is_file() and p.suffix == ".pt") or (p.is_dir() and (p / "checkpoints").is_dir()):
        return _load_flashguard(p, attn, device)
    raise ValueError(f"--model {path}: neither a Hugging Face checkpoint folder (config.json, from "
                     "save_pretrained) nor a flashguard run folder (checkpoints/) or checkpoint file (.pt)")


def _load_hf(p: Path, attn: str | None, device: str) -> Loaded:
    try:
        import transformers
    except ImportError as err:
        raise ValueError(f"--model {p}: a Hugging Face checkpoint needs transformers "
                         "(pip install 'flashguard[hf]')") from err
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()   # the check prints its own progress
    model = transformers.AutoModelForCausalLM.from_pretrained(p, attn_implementation=attn or "sdpa").to(device)
    cfg = model.config
    if any((p / f).is_file() for f in _TOKENIZER_FILES):
        tok, tok_name = transformers.AutoTokenizer.from_pretrained(p), "the checkpoint's own"
    else:
        from ..data.tokenizers import ByteTokenizer
        tok, tok_name = ByteTokenizer(), "byte (the checkpoint has no tokenizer files)"
    max_len = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    return Loaded(model, "hf", tok, tok_name, cfg.vocab_size, max_len, f"{type(model).__name__} ({p.name})")


def _run_tokenizer(cfg, vocab: int):
    """The tokenizer of a run's prepared data when it is readable and available, else bytes."""
    from ..data.meta import read_meta
    from ..data.tokenizers import ByteTokenizer, TokenizerUnavailable, get_tokenizer
    try:
        meta = read_meta(cfg.data.dir)
        tok = get_tokenizer(meta["tokenizer"])
        if tok.vocab_size <= vocab:
            return tok, f"{tok.name} (the run's data, {cfg.data.dir})"
    except (OSError, ValueError, KeyError, TypeError, TokenizerUnavailable):
        pass
    return ByteTokenizer(), "byte"


def _load_flashguard(p: Path, attn: str | None, device: str) -> Loaded:
    from ..diagnostics.run_state import pick_checkpoint
    from ..model import AttentionSpec
    from ..train.checkpoint import load_checkpoint
    from ..train.config import config_from_dict
    from ..train.loop import build_model
    ckpt = p if p.is_file() else pick_checkpoint(p, None)[1]
    try:
        state = load_checkpoint(ckpt)
        cfg = config_from_dict(state["config"])
    except (KeyError, TypeError, RuntimeError, EOFError) as e:
        raise ValueError(f"--model {ckpt}: not a flashguard checkpoint ({type(e).__name__}: {e})") from None
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    if attn is not None:
        model.set_attention(AttentionSpec(attn))
    model.to(device)
    tok, tok_name = _run_tokenizer(cfg, model.config.vocab_size)
    return Loaded(model, "flashguard", tok, tok_name, model.config.vocab_size, model.config.block_size,
                  f"flashguard GPT ({ckpt.name})")


def read_text(path) -> str:
    """The text of ``path`` (UTF-8; undecodable bytes replaced); FileNotFoundError names it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--text {path}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


def encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "pad_token_id"):      # a transformers tokenizer: no special tokens added
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer.encode(text))


def embedded_tokens(tokenizer, need: int, max_bytes: int = 4_000_000) -> list[int]:
    """At least ``need`` tokens of the embedded corpus, document by document (fewer only if the
    corpus, capped at ``max_bytes``, runs out)."""
    from ..data.sources import embedded_documents
    ids: list[int] = []
    for doc in embedded_documents(max_bytes=max_bytes):
        ids += encode(tokenizer, doc.text)
        if len(ids) >= need:
            break
    return ids


def make_batches(ids: list[int], *, steps: int, batch: int, seq_len: int, vocab: int, kind: str,
                 source: str) -> list:
    """``steps`` batches of ``batch`` consecutive windows of ``seq_len`` tokens: dicts
    (input_ids, labels) for a Hugging Face model, (x, y) shifted by one for a flashguard GPT."""
    width = seq_len + (1 if kind == "flashguard" else 0)
    need = steps * batch * width
    if len(ids) < need:
        raise ValueError(f"{source}: {len(ids)} tokens, but {steps} step(s) x {batch} sequence(s) x {width} "
                         f"tokens = {need} are needed; give a longer text or a smaller --steps / --batch / --seq-len")
    top = max(ids[:need])
    if top >= vocab:
        raise ValueError(f"{source}: token id {top} is outside the model's vocabulary ({vocab})")
    windows = torch.tensor(ids[:need], dtype=torch.long).view(steps, batch, width)   # (steps, B, width)
    if kind == "flashguard":
        return [(w[:, :-1], w[:, 1:]) for w in windows]
    return [{"input_ids": w, "labels": w} for w in windows]
