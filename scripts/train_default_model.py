"""Train the low-entropy model that rla_compile ships as its embedded default
(`rla_compile/data/qwen3-bytes`): a 4-layer Qwen3 over bytes, trained on the Python standard
library's own source (text every Python install has, so this runs offline).

    python scripts/train_default_model.py [--steps 800] [--out rla_compile/data/qwen3-bytes]

Why train at all: a random model's next-token distributions are nearly flat, so rounding noise
barely moves its logprobs; a trained model's are peaked, like a real LLM's, and that is where
train/inference mismatch shows. The weights are trained in fp32 and saved in bf16 (~2 MB).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# Byte-level: token id = byte value. 2 (STX) and 3 (ETX) never occur in the corpus and serve
# as BOS and EOS, so the model needs no tokenizer file.
CONFIG = dict(
    vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=2, eos_token_id=3,
    attention_dropout=0.0,
)


def corpus() -> tuple[bytes, bytes]:
    """The stdlib's top-level modules, in sorted order; the last 5% is held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"\n".join(f.read_bytes() for f in files)
    text = bytes(b for b in text if b not in (2, 3))
    split = int(len(text) * 0.95)
    return text[:split], text[split:]


def batches(data: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=generator)
        chunk = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, length: int = 256, n: int = 16) -> dict:
    model.eval()
    g = torch.Generator().manual_seed(1)
    x, y = next(batches(data, n, length, g))
    logits = model(x).logits.float()
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).mean()
    entropy = -(logp.exp() * logp).sum(-1)
    model.train()
    return {"loss": float(nll), "entropy": float(entropy.mean()), "top1_p": float(logp.exp().amax(-1).mean())}


def main(argv=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--out", default=str(REPO / "rla_compile" / "data" / "qwen3-bytes"))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_text, held_out_text = corpus()
    train, held_out = (torch.frombuffer(bytearray(t), dtype=torch.uint8).long() for t in (train_text, held_out_text))
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    data = batches(train, args.batch, args.length, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = model(x, labels=None).logits.flatten(0, 1).float().log_softmax(-1).gather(-1, y.flatten()[:, None]).neg().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step:>5}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s", flush=True)
    stats = evaluate(model, held_out)
    print(f"held out: loss {stats['loss']:.3f} nats/byte, mean entropy {stats['entropy']:.3f} nats, "
          f"mean top-1 p {stats['top1_p']:.3f}")
    model.to(torch.bfloat16).save_pretrained(args.out)
    # held-out text the demo and the benchmarks take their prompts from
    (Path(args.out) / "held_out.txt").write_bytes(held_out_text[:16384])
    print(f"saved {args.out}")
    return stats


if __name__ == "__main__":
    main()
