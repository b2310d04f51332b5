"""Training throughput of the tiny CPU preset with each attention backend, or against a git ref.

    python benchmarks/train.py [--steps 10] [--rounds 3] [--batch 16] [--threads N]
    python benchmarks/train.py --against GIT_REF [--configs flash+paper,flash+fa2,sdpa]
                               [--steps 3] [--rounds 5] [--threads 1] [--json PATH]

Builds the `tiny-cpu` GPT-2 (4 layers, width 256, T = 256) and runs optimizer steps
(forward, backward, AdamW) under bf16 autocast on random tokens, for attention backends
sdpa (torch), flash + paper (the study's arithmetic), flash + paper-fp32fwd (the measured fix)
and flash + fa2 (production arithmetic). Configurations are interleaved round-robin; tokens/s is the median over
rounds and the ratio is against sdpa measured in the same run. Target (trainer issue):
flash + fa2 >= 0.9x sdpa. Writes benchmarks/results/train-cpu-<threads>thread.json.

``--against GIT_REF`` measures this tree's code before / after: a temporary ``git worktree`` of
the ref is made, and one worker process per tree (PYTHONPATH = that tree's src; this tree's
uncommitted changes included) builds the same models from the same seed and trains them on the
same per-step batches. The parent interleaves them, round by round and configuration by
configuration (current first in even rounds, the ref first in odd ones, so that a drift of the
machine's speed does not favour one side), and prints tokens/s for both, the ratio current / ref
(of the medians, and per round: adjacent in time, their spread is the noise), the same by each
worker's CPU time (which waiting for a core shared with other processes does not inflate), and
whether both trained bit-identically: every step's loss (warm-up steps included) and, at the end,
a hash of every parameter and of AdamW's state. ``sdpa`` rides along as a control: its code does not change
with flashguard's, so its ratio shows the noise. The results go to
benchmarks/results/train-against-<sha>-<threads>thread.json (or ``--json``), written atomically.
Exit status 1 if the two trees did not train identically.
For a stable comparison pin the threads and the core: ``OMP_NUM_THREADS=1 taskset -c 1 python
benchmarks/train.py --against HEAD --threads 1``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG_NAMES = ("sdpa", "flash+paper", "flash+paper-fp32fwd", "flash+fa2")
REPO = Path(__file__).resolve().parent.parent


def _configs():
    from flashguard.model import AttentionSpec
    return {
        "sdpa": AttentionSpec(backend="sdpa"),
        "flash+paper": AttentionSpec(backend="flash", precision="paper"),
        "flash+fa2": AttentionSpec(backend="flash", precision="fa2"),
        "flash+paper-fp32fwd": AttentionSpec(backend="flash", precision="paper-fp32fwd"),
    }


class _Setup:
    """One configuration's model, optimizer and step: the same code in the table and in a worker."""

    def __init__(self, name: str, batch: int):
        import torch
        from flashguard.model import GPT, model_config
        self.cfg = model_config("tiny-cpu")
        torch.manual_seed(0)
        self.model = GPT(self.cfg, _configs()[name])
        self.opt = self.model.configure_optimizer(weight_decay=0.0, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        self.batch = batch
        self.tokens_per_step = batch * self.cfg.block_size

    def step(self, x, y) -> float:
        import torch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def digest(self) -> str:
        """sha256 of every parameter's bytes and of the optimizer's state, in a fixed order."""
        import torch

        def raw(t):
            return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            h.update(name.encode() + raw(p))
        for state in self.opt.state.values():
            for key in sorted(state):
                h.update(key.encode() + raw(state[key]))
        return h.hexdigest()


def _batches(cfg, batch: int, n: int):
    """``n`` (x, y) batches of random tokens from a fixed seed: the same in every tree."""
    import torch
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# the per-backend table (one process)

def table(args) -> None:
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, rounds = args.steps or 10, args.rounds or 3
    setups = {name: _Setup(name, args.batch) for name in CONFIG_NAMES}
    cfg = setups["sdpa"].cfg
    x, y = _batches(cfg, args.batch, 1)[0]

    def run(name, n):
        s = setups[name]
        t0 = time.perf_counter()
        for _ in range(n):
            s.step(x, y)
        return s.tokens_per_step * n / (time.perf_counter() - t0)

    for name in CONFIG_NAMES:
        run(name, 2)  # warm-up
    rates = {n: [] for n in CONFIG_NAMES}
    for _ in range(rounds):
        for name in CONFIG_NAMES:
            rates[name].append(run(name, steps))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny-cpu, batch {args.batch} x "
          f"T {cfg.block_size}, bf16 autocast, {rounds} rounds of {steps} steps")
    base = statistics.median(rates["sdpa"])
    print(f"{'attention':<18}{'tokens/s':>10}{'x sdpa':>8}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<18}{med:>10.0f}{med / base:>8.2f}")
    ok = statistics.median(rates["flash+fa2"]) / base >= 0.9
    print(f"  {'PASS' if ok else 'MISS'}  flash + fa2 >= 0.9x sdpa")
    from machine import machine
    from flashguard.utils.atomic import atomic_write_text
    path = Path(args.json) if args.json else REPO / "benchmarks" / "results" / \
        f"train-cpu-{torch.get_num_threads()}thread.json"
    atomic_write_text(path, json.dumps({
        "torch": torch.__version__, "machine": machine(), "threads": torch.get_num_threads(), "batch": args.batch,
        "block_size": cfg.block_size, "steps": steps, "rounds": rounds, "tokens_per_s": rates,
        "median_tokens_per_s": {n: statistics.median(r) for n, r in rates.items()},
        "x_sdpa": {n: statistics.median(r) / base for n, r in rates.items()}}, indent=1) + "\n")
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------------
# --against: a worker per tree, driven over stdin / stdout (one JSON object a line)

def worker(args) -> None:
    """Serve requests: {"config", "steps"} -> {"seconds", "cpu_seconds", "losses"};
    {"digest": config} -> {"digest"}."""
    import torch
    import flashguard
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    setups = {name: _Setup(name, args.batch) for name in names}
    cfg = next(iter(setups.values())).cfg
    batches = _batches(cfg, args.batch, args.total_steps)
    done = {name: 0 for name in names}
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    out.write(json.dumps({"ready": True, "flashguard": flashguard.__file__, "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "tokens_per_step": setups[names[0]].tokens_per_step}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if "digest" in req:
            reply = {"digest": setups[req["digest"]].digest()}
        else:
            name, n = req["config"], req["steps"]
            s, i = setups[name], done[name]
            if i + n > len(batches):
                raise SystemExit(f"worker: asked for more than --total-steps {len(batches)} steps")
            t0, c0 = time.perf_counter(), time.process_time()
            losses = [s.step(*batches[j]) for j in range(i, i + n)]
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            done[name] = i + n
            reply = {"seconds": dt, "cpu_seconds": dc, "losses": [float(v).hex() for v in losses]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _Worker:
    def __init__(self, label: str, src: Path, args, total_steps: int):
        self.label = label
        # the tree's src first on the path: it wins over the editable install of this tree
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--configs", args.configs,
               "--batch", str(args.batch), "--total-steps", str(total_steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     cwd=tempfile.gettempdir())  # not a folder with a flashguard of its own
        self.hello = self._read()
        got = Path(self.hello["flashguard"]).resolve()
        if not got.is_relative_to(Path(src).resolve()):
            raise SystemExit(f"{label}: the worker imported {got}, not the tree's {src}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.label}: the worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True).stdout.strip()


def against(args) -> int:
    from flashguard.utils.atomic import atomic_write_json
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIG_NAMES))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIG_NAMES)}")
    steps, rounds, warmup = args.steps or 3, args.rounds or 5, args.warmup
    total = warmup + rounds * steps
    try:
        sha = _git("rev-parse", "--verify", f"{args.against}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--against {args.against!r}: not a commit ({e.stderr.strip()})") from None
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    tmp = Path(tempfile.mkdtemp(prefix="flashguard-bench-"))
    tree = tmp / "ref"
    _git("worktree", "add", "--detach", str(tree), sha)
    workers = []
    try:
        workers = [_Worker("current", REPO / "src", args, total), _Worker(f"ref {sha[:10]}", tree / "src", args, total)]
        cur, ref = workers
        tokens = cur.hello["tokens_per_step"]
        losses = {n: {"current": [], "ref": []} for n in names}
        rates = {n: {"current": [], "ref": []} for n in names}
        cpu_rates = {n: {"current": [], "ref": []} for n in names}
        for name in names:  # warm-up: not timed, losses compared
            for w, side in ((cur, "current"), (ref, "ref")):
                if warmup:
                    losses[name][side] += w.ask(config=name, steps=warmup)["losses"]
        for r in range(rounds):
            for name in names:
                order = ((cur, "current"), (ref, "ref")) if r % 2 == 0 else ((ref, "ref"), (cur, "current"))
                for w, side in order:
                    reply = w.ask(config=name, steps=steps)
                    losses[name][side] += reply["losses"]
                    rates[name][side].append(tokens * steps / reply["seconds"])
                    cpu_rates[name][side].append(tokens * steps / reply["cpu_seconds"])
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {rates[n]['current'][-1] / rates[n]['ref'][-1]:.3f}x" for n in names), flush=True)
        digests = {n: {"current": cur.ask(digest=n)["digest"], "ref": ref.ask(digest=n)["digest"]} for n in names}
    finally:
        for w in workers:
            w.close()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
        try:
            tmp.rmdir()
        except OSError:
            pass

    threads = cur.hello["threads"]
    print(f"torch {cur.hello['torch']}, {threads} thread(s) per worker; tiny-cpu, batch {args.batch} x T "
          f"{tokens // args.batch}, bf16 autocast; {rounds} rounds of {steps} steps, interleaved, after "
          f"{warmup} warm-up steps")
    print(f"current: {head[:10]}{' + uncommitted changes' if dirty else ''}   ref: {args.against} = {sha[:10]}")
    print("tokens/s by the wall clock, median over rounds; ratio = current / ref of the medians, then the\n"
          "per-round ratios' median and range; cpu = by each worker's CPU time (process_time: waiting for a busy\n"
          "core not counted)")
    print(f"{'attention':<16}{'current tok/s':>14}{'ref tok/s':>10}{'ratio':>8}{'per round: median':>19}"
          f"{'min..max':>15}{'cpu ratio':>11}{'cpu min..max':>15}  identical")
    results, all_same = {}, True
    for name in names:
        c, f = rates[name]["current"], rates[name]["ref"]
        cc, cf = cpu_rates[name]["current"], cpu_rates[name]["ref"]
        per_round = [a / b for a, b in zip(c, f)]
        cpu_round = [a / b for a, b in zip(cc, cf)]
        same_loss = losses[name]["current"] == losses[name]["ref"]
        same_params = digests[name]["current"] == digests[name]["ref"]
        all_same &= same_loss and same_params
        mc, mf = statistics.median(c), statistics.median(f)
        cpu_ratio = statistics.median(cc) / statistics.median(cf)
        results[name] = {
            "tokens_per_s": {"current": c, "ref": f}, "median_tokens_per_s": {"current": mc, "ref": mf},
            "ratio_of_medians": mc / mf, "ratio_per_round": per_round, "ratio_median": statistics.median(per_round),
            "ratio_min": min(per_round), "ratio_max": max(per_round),
            "cpu_tokens_per_s": {"current": cc, "ref": cf}, "cpu_ratio_of_medians": cpu_ratio,
            "cpu_ratio_per_round": cpu_round, "cpu_ratio_min": min(cpu_round), "cpu_ratio_max": max(cpu_round),
            "losses_identical": same_loss, "parameters_identical": same_params, "steps_compared": total,
            "losses": losses[name]["current"],
            **({} if same_loss else {"losses_ref": losses[name]["ref"]}),
        }
        verdict = "yes" if same_loss and same_params else ("losses differ" if not same_loss else "params differ")
        print(f"{name:<16}{mc:>14.0f}{mf:>10.0f}{mc / mf:>7.3f}x{statistics.median(per_round):>18.3f}x"
              f"{min(per_round):>8.3f}..{max(per_round):.3f}{cpu_ratio:>10.3f}x"
              f"{min(cpu_round):>8.3f}..{max(cpu_round):.3f}  {verdict} ({total} steps)")
    record = {"benchmark": "train --against", "torch": cur.hello["torch"], "threads": threads,
              "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "shape": {"preset": "tiny-cpu", "batch": args.batch, "block_size": tokens // args.batch,
                        "autocast": "bf16"},
              "steps_per_round": steps, "rounds": rounds, "warmup_steps": warmup,
              "current": {"head": head, "uncommitted_changes": dirty},
              "ref": {"name": args.against, "sha": sha},
              "identical": all_same, "configs": results, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    default = REPO / "benchmarks" / "results" / f"train-against-{sha[:10]}-{threads}thread.json"
    path = Path(args.json) if args.json else default
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, indent=1)
    print(f"{'IDENTICAL' if all_same else 'NOT IDENTICAL'}: losses and parameters of both trees; written {path}")
    return 0 if all_same else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per round (10; --against: 3)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (3; --against: 5)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--against", metavar="GIT_REF", help="time this tree against a commit, interleaved (see above)")
    ap.add_argument("--configs", default="flash+paper,flash+fa2,sdpa",
                    help=f"--against: comma-separated, of {', '.join(CONFIG_NAMES)} (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="--against: untimed steps first (default: %(default)s)")
    ap.add_argument("--json", help="the results file (default: benchmarks/results/train-cpu-<threads>thread.json; "
                    "--against: train-against-<sha>-<threads>thread.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for flag in ("steps", "rounds", "batch", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.worker:
        worker(args)
    elif args.against:
        sys.exit(against(args))
    else:
        table(args)


if __name__ == "__main__":
    main()
