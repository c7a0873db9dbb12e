"""Train fp8lab's demo model (``fp8lab.engine.demo``) from scratch: a development script, torch on a GPU.

    python tools/demo_corpus.py .data/corpus                   # the corpus (Debian packages), on any CPU
    python tools/train_demo.py prepare .data/corpus .data/demo  # tokenizer + token ids, on any CPU
    python tools/train_demo.py train .data/demo OUT             # on a CUDA GPU (minutes on an H200)

``prepare`` trains the byte-level BPE on the training split (``fp8lab.engine.demo.train_tokenizer``) and
writes ``tokenizer.json`` and the token ids of both splits (``train.npy``, ``heldout.npy``, uint16,
documents joined by ``<|endoftext|>``).

``train`` builds transformers' ``Qwen3ForCausalLM`` from ``fp8lab.engine.demo.demo_config()`` (so the model
trained is exactly the architecture fp8lab runs), trains it on random 512-token windows of the
training ids (AdamW, bf16 autocast over float32 master weights, linear warm-up then cosine decay,
gradient clipping), evaluates the held-out loss as it goes, and writes ``OUT/checkpoint``, the BF16
checkpoint (``fp8lab.engine.demo.save_demo_checkpoint``: weights rounded to BF16 once, at the end), and
``OUT/training_log.json`` (arguments, losses, timings, samples, the held-out perplexity of the
BF16 weights in float32 with transformers, chunks of 512 tokens: an independent check of
``fp8lab eval``). Everything random is drawn from generators seeded by ``--seed``. ``--steps 0``
(the default) sets the step count once, from the speed of the first steps, to fit ``--budget-s``
seconds; the log records the count, and ``--steps N`` repeats the run (GPU kernels may differ in
the last bits between runs: cuBLAS and the attention backward are not bitwise deterministic).

torch and transformers are needed here only: fp8lab itself never imports them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8lab.engine import demo  # noqa: E402
from fp8lab.engine.tokenizer import ENDOFTEXT  # noqa: E402

DEVICE = "cuda"
"""Where ``train`` runs (``--device cpu`` is for a smoke test of this script, a few steps)."""
SAMPLE_PROMPTS = ("The os module provides", "def read_config(path):", "A list comprehension",
                  "import json\n", "The :mod:`asyncio` event loop")


# ---------------------------------------------------------------------------- prepare (CPU)


def documents(path: Path) -> list[str]:
    """The documents of a split file (``tools/demo_corpus.py`` joins them with ``DOC_SEPARATOR``)."""
    from demo_corpus import DOC_SEPARATOR

    return path.read_text(encoding="utf-8").split(DOC_SEPARATOR)


def token_ids(tokenizer, docs: list[str]) -> np.ndarray:
    """All documents' ids, each followed by ``<|endoftext|>``, as one uint16 array."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    encoded = tokenizer.encode_batch(docs)
    ids = np.concatenate([np.append(np.asarray(e.ids, dtype=np.uint16), np.uint16(eot)) for e in encoded])
    return ids


def prepare(corpus: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = demo.train_tokenizer(corpus / "train.txt")
    tokenizer.save(str(out / "tokenizer.json"))
    for split in ("train", "heldout"):
        ids = token_ids(tokenizer, documents(corpus / f"{split}.txt"))
        np.save(out / f"{split}.npy", ids)
        print(f"{split}: {len(ids):,} tokens")


# ---------------------------------------------------------------------------- train (GPU)


def hf_model(torch):
    """``Qwen3ForCausalLM`` with ``demo_config()``, float32, on ``DEVICE``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = demo.demo_config().to_dict()
    config.pop("torch_dtype")
    hf_config = Qwen3Config(**config, attn_implementation="sdpa")
    return Qwen3ForCausalLM(hf_config).to(DEVICE, torch.float32)


def learning_rate(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``peak`` to ``floor`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def windows(data, starts, context: int, torch):
    """``[len(starts), context + 1]`` token windows of the device array ``data``."""
    return data[starts[:, None] + torch.arange(context + 1, device=data.device)].long()


def mean_loss(model, batch, torch, autocast: bool = True):
    """Mean next-token cross-entropy of a ``[B, T + 1]`` window batch (float32 logits)."""
    import torch.nn.functional as F

    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def heldout_batches(heldout, context: int, count: int, torch):
    """``count`` windows at evenly spaced offsets of the held-out ids (the same every evaluation)."""
    starts = torch.linspace(0, len(heldout) - context - 2, count, device=heldout.device).long()
    return windows(heldout, starts, context, torch)


def chunked_perplexity(model, heldout, chunk: int, torch) -> float:
    """Perplexity of the held-out ids in non-overlapping chunks of ``chunk`` tokens, float32, no autocast
    (the protocol of ``fp8lab eval``: within a chunk, token i + 1 is predicted from tokens 0..i)."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(heldout) - 1, chunk):
            ids = heldout[start : start + chunk].long()[None]
            if ids.shape[1] < 2:
                break
            logits = model(input_ids=ids).logits.double()
            total += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return math.exp(total / count)


def samples(model, tokenizer, torch, new_tokens: int = 48) -> dict[str, str]:
    """Greedy continuations of ``SAMPLE_PROMPTS`` (to see that the text is recognisable)."""
    out = {}
    with torch.no_grad():
        for prompt in SAMPLE_PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt).ids], device=DEVICE)
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            out[prompt] = tokenizer.decode(gen[0, ids.shape[1]:].tolist())
    return out


def bf16_tensors(model) -> dict[str, np.ndarray]:
    """The weights under Qwen3's names as float32 arrays holding BF16 values (the tied lm_head left out)."""
    from fp8lab.reference.dense import round_to_bf16

    state = model.state_dict()
    return {name: round_to_bf16(t.detach().float().cpu().numpy()) for name, t in state.items()
            if name != "lm_head.weight"}


def synchronize(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def train(data: Path, out: Path, args) -> None:
    import torch
    from tokenizers import Tokenizer

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int32)).to(DEVICE)
    heldout_ids = torch.from_numpy(np.load(data / "heldout.npy").astype(np.int32)).to(DEVICE)
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    model = hf_model(torch)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=DEVICE == "cuda")
    params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator(device=DEVICE).manual_seed(args.seed)
    heldout_batch = heldout_batches(heldout_ids, demo.CONTEXT, 64, torch)
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "parameters": params,
           "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids), "train": [], "heldout": []}
    steps = args.steps or args.max_steps
    start = time.perf_counter()
    step = 0
    while step < steps:
        lr = learning_rate(step, steps, args.lr, args.warmup, args.lr * 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - demo.CONTEXT - 1, (args.batch,), device=DEVICE, generator=generator)
        loss = mean_loss(model, windows(train_ids, starts, demo.CONTEXT, torch), torch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            log["train"].append([step, loss.item()])
        if step == 10:
            synchronize(torch)
            warm = time.perf_counter()  # the first steps pay for start-up: calibrate on the later ones
        if step == args.calibrate_at and not args.steps:
            synchronize(torch)
            per_step = (time.perf_counter() - warm) / (step - 10)
            fit = int((args.budget_s - (time.perf_counter() - start)) / per_step) + step
            steps = max(args.warmup + 100, min(args.max_steps, fit // 100 * 100))
            print(f"{per_step * 1e3:.1f} ms per step: {steps} steps fit the {args.budget_s} s budget", flush=True)
        if step % args.eval_every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                held = mean_loss(model, heldout_batch, torch).item()
            model.train()
            log["heldout"].append([step, held])
            print(f"step {step}/{steps}  lr {lr:.2e}  train {loss.item():.3f}  heldout {held:.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    synchronize(torch)
    log["steps"] = steps
    log["train_seconds"] = time.perf_counter() - start
    log["tokens_seen"] = steps * args.batch * demo.CONTEXT
    model.eval()
    # the checkpoint holds BF16 weights: measure those (float32 compute), as fp8lab will run them
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    log["heldout_ppl_transformers_fp32"] = chunked_perplexity(model, heldout_ids[: args.ppl_tokens or None], 512, torch)
    log["samples"] = samples(model, tokenizer, torch)
    out.mkdir(parents=True, exist_ok=True)
    demo.save_demo_checkpoint(out / "checkpoint", bf16_tensors(model), tokenizer)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: log[k] for k in ("parameters", "steps", "train_seconds", "tokens_seen",
                                          "heldout_ppl_transformers_fp32")}, indent=1))
    for prompt, text in log["samples"].items():
        print(f"--- {prompt!r} ->\n{text}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train fp8lab's demo model (see the module docstring).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenizer and token ids from the corpus (CPU)")
    p.add_argument("corpus", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("train", help="train on a CUDA GPU and write the BF16 checkpoint")
    p.add_argument("data", type=Path, help="the folder 'prepare' wrote")
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="windows of 512 tokens per step (default 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--steps", type=int, default=0, help="0 (default): as many as fit --budget-s")
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--budget-s", type=float, default=270.0)
    p.add_argument("--calibrate-at", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--ppl-tokens", type=int, default=0, help="held-out tokens for the final perplexity (0: all)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = getattr(args, "device", DEVICE)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.command == "prepare":
        prepare(args.corpus, args.out)
    else:
        train(args.data, args.out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
