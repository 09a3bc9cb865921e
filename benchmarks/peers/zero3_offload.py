"""Peer of tandem's trainer: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to pinned CPU memory.

    python benchmarks/peers/zero3_offload.py --preset 3b --batch 8 --seq 2048 --warmup 2 --steps 4
    python benchmarks/peers/zero3_offload.py --preset 3b --gpu-cap-gib 16     # the GPU memory tandem's 3b run gets

One GPU, one process (no launcher: the rank variables are set here). The model is tandem's trainer
preset (``tandem.shared.train.presets``: the same shapes, untied head, 32000-token vocabulary, so the
same parameter count) built as a transformers ``LlamaForCausalLM`` with SDPA attention and every
decoder layer checkpointed (recomputed in the backward, as tandem's streamed layers are). DeepSpeed
runs it in bf16 with ZeRO stage 3, parameters and fp32 optimizer state in pinned host memory, and
the AdamW of its config, which with the optimizer offloaded is DeepSpeedCPUAdam (the line names the
class it got). The optimizer settings are tandem's benchmark job's: lr 1e-4, betas (0.9, 0.95), eps
1e-8, no weight decay, gradients clipped to norm 1.0.

Each step draws its batch as tandem's ``random`` dataset does (``TokenData.batch``: the same seeded
windows of uniform random tokens, inputs and the targets shifted by one), runs forward, backward and
the optimizer step, and is timed between device syncs. The first ``--warmup`` steps (the CPU Adam's
first use, the allocator's growth) are not timed; the median of the next ``--steps`` is. Prints one
JSON line: tokens/s, model TFLOP/s (tandem's formula: (6N + 6·L·d·seq) per token, recompute not
counted), peak GPU memory (allocated and reserved) and the process's peak resident host memory.

Needs CUDA and deepspeed (imported in ``main``, so ``--help`` works without it); without deepspeed
it exits non-zero with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

PRESETS = ("1b", "3b", "7b")
LR, BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.0, 1.0  # benchmarks/train_offload.py's job


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="3b", choices=PRESETS, help="tandem's trainer preset (model shape)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (the median is printed)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--gpu-cap-gib", type=float, default=0.0,
                    help="cap this process's GPU memory (set_per_process_memory_fraction); 0: the whole GPU")
    ap.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches (tandem's job seed)")
    args = ap.parse_args(argv)
    if min(args.batch, args.seq - 1, args.steps) < 1 or args.warmup < 0:
        ap.error("--batch and --steps must be positive, --seq at least 2, --warmup not negative")
    return args


def deepspeed_config(args: argparse.Namespace) -> dict:
    """ZeRO-3, parameters and optimizer state in pinned host memory, the usual offload tuning
    (large prefetch and live-parameter budgets so the next layer's gather overlaps this one's math)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": GRAD_CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": int(1e9),
            "stage3_prefetch_bucket_size": int(5e8),
            "stage3_param_persistence_threshold": int(1e6),
            "reduce_bucket_size": int(5e8),
            "sub_group_size": int(1e9),
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def single_process_rank() -> None:
    """The variables a launcher would set, for one rank on this host (a free port: other runs may be up)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        os.environ.setdefault(name, value)


def batch(step: int, size: int, seq: int, vocab: int, seed: int):  # noqa: ANN201 - (inputs, targets) tensors
    """tandem's ``TokenData.batch`` for the ``random`` dataset: the same generator seed per step."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    window = torch.randint(0, vocab, (size, seq + 1), generator=gen)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def build_model(preset: str):  # noqa: ANN201 - transformers.LlamaForCausalLM
    """tandem's preset as a transformers model in bf16 on the host, every decoder layer checkpointed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.shared.train.presets import preset_config

    fields = preset_config(preset).to_hf_dict()
    fields.pop("tandem_tokenizer", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # DeepSpeed's bf16 mode casts to it anyway; half the host bytes
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model.train()  # transformers checkpoints layers only in training mode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import deepspeed
    except Exception as missing:  # noqa: BLE001 - an import of deepspeed can fail in many ways; all end here
        reason = (str(missing).strip().splitlines() or [type(missing).__name__])[0]
        raise SystemExit(f"zero3_offload.py needs deepspeed (pip install deepspeed): {reason}") from None
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("zero3_offload.py needs a CUDA device: DeepSpeed's ZeRO-3 offload runs the model on a GPU")
    if args.gpu_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * 2**30 / total))
    single_process_rank()
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    model = build_model(args.preset)
    config = model.config
    num_params = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=deepspeed_config(args))
    init_s = time.perf_counter() - started
    base_optimizer = getattr(optimizer, "optimizer", optimizer)
    device = engine.device
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = batch(step, args.batch, args.seq, config.vocab_size, args.seed)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = engine(input_ids=inputs).logits
        # every position's next token, as tandem's loss counts them (not transformers' shift by one more)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, config.vocab_size), targets.view(-1))
        del logits
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(round(loss.item(), 3))
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    flops_per_token = 6 * num_params + 6 * config.num_hidden_layers * config.hidden_size * args.seq
    print(json.dumps({
        "peer": "deepspeed_zero3_offload", "preset": args.preset, "params_B": round(num_params / 1e9, 3),
        "batch": args.batch, "seq": args.seq, "dtype": "bfloat16", "activation_checkpointing": True,
        "optimizer": type(base_optimizer).__name__, "gpu_cap_GiB": args.gpu_cap_gib or None,
        "warmup": args.warmup, "steps": args.steps,
        "step_s_median": round(step_s, 3), "tokens_per_s": round(tokens / step_s),
        "model_TFLOPs": round(flops_per_token * tokens / step_s / 1e12, 1),
        "step_times": [round(t, 3) for t in times], "losses": losses, "init_s": round(init_s, 1),
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        "peak_gpu_reserved_GiB": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
        "peak_host_rss_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "gpu": torch.cuda.get_device_name(device), "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
