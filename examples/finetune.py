"""Fine-tune a checkpoint on your own data, end to end, with nothing downloaded.

    python examples/finetune.py --out runs/finetune-example

writes into --out (legend: no tensors here; the files are what a user brings):
    base/          a BPE tokenizer trained on glm53's built-in corpus (tokenizers library, saved with
                   transformers, with a small chat template) and a tiny random glm53 checkpoint (save_pretrained)
    train.jsonl    SFT records: {"prompt", "completion"} and {"messages"} (loss on the answers only)
    heldout.jsonl  the same kind of records, never trained on
then runs
    python -m glm53 train --init OUT/base --data OUT/train.jsonl --seq-len 128 --steps 40 --save OUT/tuned
and prints the held-out loss of base/ and tuned/. Replace base/ by a real checkpoint directory (weights, config
and tokenizer files) and train.jsonl by your data to fine-tune for real; tests/training/test_finetune.py uses
the builders below.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.training.data import corpus_text
from glm53.training.finetune import heldout_loss

SPECIAL = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]  # <|pad|> gets id 0
BPE_VOCAB = 512  # byte alphabet + specials + the merges the ~1 KB corpus supports
VOCAB_MULTIPLE = 64  # the model's vocabulary rounded up (splits over tensor-parallel ranks)
# Each message as "<|role|>\n content", an assistant's ending in <|endoftext|>; the generation prompt is the
# assistant header, so the trained tokens are exactly the answer, its end token and the newline after it
# (written as {{ '\\n' }}: transformers renders with trim_blocks, which drops a newline right after a tag).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(chat_template: bool = True):
    """A byte-level BPE tokenizer trained on the built-in corpus (save it with `.save_pretrained(DIR)`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    if chat_template:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def build_checkpoint(path: str, vocab_size: int, seed: int = 0) -> None:
    """A tiny random glm53 checkpoint (official layout) whose vocabulary covers the tokenizer's."""
    torch.manual_seed(seed)
    rows = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = Glm53Config.tiny(vocab_size=rows, num_nextn_predict_layers=1, pad_token_id=0)
    Glm53ForCausalLM(config).save_pretrained(path, overwrite=True)


def sft_records(seed: int) -> tuple[list[dict], list[dict]]:
    """Records about the corpus's sentences, (train, heldout) from disjoint sentences: for each sentence a
    "finish the sentence" question in both SFT formats (cut after a third and after half of its words)."""
    sentences = [s.strip() + "." for line in corpus_text().splitlines() for s in line.split(".") if s.strip()]
    random.Random(seed).shuffle(sentences)
    cut = len(sentences) * 4 // 5
    return [r for s in sentences[:cut] for r in _questions(s)], [r for s in sentences[cut:] for r in _questions(s)]


def _questions(sentence: str) -> list[dict]:
    words = sentence.split()
    out = []
    for k, cut in enumerate((len(words) // 3, len(words) // 2)):
        prompt, answer = f"Finish the sentence: {' '.join(words[:cut])}", " ".join(words[cut:])
        if k == 0:
            out.append({"prompt": prompt, "completion": answer})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "You complete sentences."},
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def prepare(out: str, seed: int = 0) -> dict[str, str]:
    """Tokenizer + checkpoint in OUT/base, OUT/train.jsonl, OUT/heldout.jsonl -> their paths."""
    paths = {
        "base": os.path.join(out, "base"),
        "train": os.path.join(out, "train.jsonl"),
        "heldout": os.path.join(out, "heldout.jsonl"),
    }
    os.makedirs(out, exist_ok=True)
    tokenizer = build_tokenizer()
    build_checkpoint(paths["base"], len(tokenizer), seed)
    tokenizer.save_pretrained(paths["base"])  # the tokenizer files beside the weights, as in a release
    train, heldout = sft_records(seed)
    write_jsonl(paths["train"], train)
    write_jsonl(paths["heldout"], heldout)
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/finetune-example")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    paths = prepare(args.out)
    tuned = os.path.join(args.out, "tuned")
    cmd = [
        sys.executable,
        "-m",
        "glm53",
        "train",
        "--init",
        paths["base"],
        "--data",
        paths["train"],
        "--seq-len",
        "128",
        "--batch-size",
        "4",
        "--steps",
        str(args.steps),
        "--lr",
        "3e-3",
        "--log-every",
        "10",
        "--save",
        tuned,
        "--overwrite",
    ]  # a second run of the example replaces its own tuned/
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    for name, ckpt in (("base", paths["base"]), ("tuned", tuned)):
        loss = heldout_loss(Glm53ForCausalLM.from_pretrained(ckpt), paths["heldout"], ckpt, seq_len=128)
        print(f"held-out loss of {name}: {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
