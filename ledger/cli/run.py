"""`ledger run prepare/train/recover/eval/serve/experiment`, `ledger replay` and `ledger compare-runs`: the commands
that run the experiment. They import torch and the runners, but only when called, so `ledger --help` stays fast.
This module is the composition root's runner half: the only CLI code that imports runners."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ledger.cli.common import (
    INT64_MAX,
    ConfigOpt,
    DbOpt,
    JsonOpt,
    PreparedOpt,
    RunDbOpt,
    WorkdirOpt,
    add_row,
    emit,
    emit_json,
    err,
    open_store,
    out,
    print_wide,
    run_db,
)

HostsOpt = Annotated[bool, typer.Option("--hosts", help="One rank (replica) per namespace host of `ledger hosts up` "
                                        "(docs/hosts.md).")]


def _hosts(on: bool, n: int, url: str) -> Any:
    """The live namespace hosts for ``n`` ranks, or None when ``--hosts`` is not given; InputError when the ranks
    or this process cannot reach the ledger ``url`` (a server over TCP: at the switch, and this command run there)."""
    if not on:
        return None
    from runners.hosts import check_ledger_reach, require

    hosts = require(n)
    check_ledger_reach(url, hosts)
    return hosts


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    run_app.command("prepare")(prepare_cmd)
    run_app.command("train")(train_cmd)
    run_app.command("experiment")(experiment_cmd)
    run_app.command("recover")(recover_cmd)
    run_app.command("eval")(eval_cmd)
    run_app.command("serve")(run_serve_cmd)
    app.command("serve")(serve_cmd)
    app.command("replay")(replay_cmd)
    run_app.command("replay")(replay_cmd)
    app.command("compare-runs")(compare_runs_cmd)


def _with_progress(label: str, total: int, progress_file: Path, work: Any) -> Any:
    """Run ``work()`` in a thread while showing rank 0's progress (step, loss, tokens/s) from its progress file."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(label, total=total, info="")
        while thread.is_alive():
            thread.join(0.25)
            try:
                p = json.loads(progress_file.read_text())
            except (OSError, ValueError):
                continue
            rate = p["tokens"] / p["seconds"] if p.get("seconds") else 0.0
            bar.update(task, completed=p["step"], info=f"loss {p['loss']:.4f}  {rate:,.0f} tok/s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def prepare_cmd(workdir: WorkdirOpt = Path("experiment"), config: ConfigOpt = None, db: RunDbOpt = None,
                json_out: JsonOpt = False) -> None:
    """Generate data, tokenizer and seed model; record prepare, selection and contract receipts."""
    from runners.prepare import run_prepare

    workdir.mkdir(parents=True, exist_ok=True)
    summary = run_prepare(config, workdir, run_db(db, workdir))
    emit(summary, json_out, "\n".join(f"{k}: {v}" for k, v in summary.items() if not isinstance(v, dict)))


def train_cmd(
    arm: Annotated[str, typer.Option("--arm", help="single | ddp-four | diloco-four | all")],
    workdir: WorkdirOpt = Path("experiment"),
    db: RunDbOpt = None,
    prepared: PreparedOpt = None,
    steps: Annotated[int | None, typer.Option(help="Stop after this step (default: the config's).", min=0,
                                              max=INT64_MAX)] = None,
    on_hosts: HostsOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Train an arm on torch.distributed (gloo on CPU), every rank emitting receipts; then its summary."""
    from ledger.errors import RunFailed
    from ledger.experiment.config import ARMS
    from runners.train import summarize_arm, train_arm

    arms = list(ARMS) if arm == "all" else [arm]
    for a in arms:
        if a not in ARMS:
            raise typer.BadParameter(f"unknown arm {a!r}; choose from {', '.join(ARMS)} or all", param_hint="--arm")
    url = run_db(db, workdir)
    total = steps or _config_steps(url, workdir, prepared)  # the experiment found before anything is written
    hosts = _hosts(on_hosts, max(ARMS[a].world for a in arms), url)
    results = []
    for a in arms:
        progress = workdir / "logs" / f"progress-{a}.json"
        progress.parent.mkdir(parents=True, exist_ok=True)
        progress.unlink(missing_ok=True)
        started = time.perf_counter()
        launched, run = _with_progress(
            f"train {a}", total, progress,
            lambda a=a, progress=progress: train_arm(workdir, url, a, prepared=prepared, steps=steps,
                                                     extra=["--progress", str(progress)], hosts=hosts),
        )
        if not launched.ok:
            raise RunFailed(a, launched.failed_rank, list(launched.returncodes),
                            str(workdir / "logs" / run.replace("/", "_")))
        with open_store(url) as store:
            summary = summarize_arm(store, store.latest_prepared(prepared), a, run)
        m = summary.measurements
        results.append({"arm": a, "run": run, "summary": summary.id, "seconds": time.perf_counter() - started,
                        "max_rank_loop_seconds": m["max_rank_loop_seconds"],
                        "total_sent_bytes": m["total_sent_bytes"], "parameter_digest": m["parameter_digest"],
                        "ratios": m["ratios"]})
    emit(results, json_out, "\n".join(
        f"{r['arm']}: {r['summary']}  loop {r['max_rank_loop_seconds']:.1f}s  sent {r['total_sent_bytes']:,} B"
        f"  model {r['parameter_digest'][:19]}" for r in results))


def experiment_cmd(
    workdir: WorkdirOpt = Path("experiment"),
    config: ConfigOpt = None,
    db: RunDbOpt = None,
    on_hosts: HostsOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """The whole experiment on an embedded SQLite ledger: prepare, train the three arms, recover the primary
    arm after killing a rank, evaluate, then audit everything from the ledger."""
    from runners.experiment import run_experiment

    def step(name: str) -> None:
        err.print(f"[{time.strftime('%H:%M:%S')}] {name}", highlight=False)

    url = run_db(db, workdir)
    result = run_experiment(workdir, url, config, on_step=step, train_progress=_with_progress,
                            hosts=_hosts(on_hosts, 4, url))
    if json_out:
        emit_json(result.to_json())
        return
    value = result.to_json()
    out.print(f"experiment {value['prepared']}\nledger {value['db']}\nreport {value['report']}\n"
              f"page {value['html']}\n"
              f"audit {value['audit']}\ncontracts " + ", ".join(
                  f"{k} {'PASS' if v else 'FAIL'}" for k, v in value["contracts"].items())
              + "\n" + "  ".join(f"{k} {v:.0f}s" for k, v in value["seconds"].items()))
    out.print(f"verify any receipt: ledger verify --db {value['db']} <id>; the audit: ledger audit --db {value['db']}")


def recover_cmd(
    workdir: WorkdirOpt = Path("experiment"),
    db: RunDbOpt = None,
    arm: Annotated[str | None, typer.Option("--arm", help="The arm to recover (default: the contract's primary "
                                            "arm).")] = None,
    kill_rank: Annotated[int, typer.Option("--kill-rank", help="The rank to SIGKILL.", min=0, max=INT64_MAX)] = 1,
    kill_after_step: Annotated[
        int | None, typer.Option("--kill-after-step", help="Kill right after this step (default: a little past "
                                 "the first checkpoint).")] = None,
    prepared: PreparedOpt = None,
    steps: Annotated[int | None, typer.Option(help="Stop after this step (default: the config's).", min=0,
                                              max=INT64_MAX)] = None,
    resume_fault: Annotated[
        str | None, typer.Option("--resume-fault", hidden=True,
                                 help="Restart wrongly on purpose (tests and demonstrations of the proof).")
    ] = None,
    on_hosts: HostsOpt = False,
    kill_host: Annotated[bool, typer.Option("--kill-host", help="With --hosts: the killed rank's host dies too "
                                            "(link, processes, namespace); the restart runs on it made anew.")]
    = False,
    json_out: JsonOpt = False,
) -> None:
    """Kill a rank mid-run, restart the group from the last common checkpoint, and prove every rank ends
    exactly where the uninterrupted run ends (exit 1 if any rank diverges)."""
    from runners.recover import run_recover
    from runners.train import RESUME_FAULTS
    from verify.recovery import divergence, rank_passed

    if resume_fault is not None and resume_fault not in RESUME_FAULTS:
        raise typer.BadParameter(f"choose from {', '.join(RESUME_FAULTS)}", param_hint="--resume-fault")
    if kill_host and not on_hosts:
        raise typer.BadParameter("only a namespace host can die: add --hosts", param_hint="--kill-host")
    url = run_db(db, workdir)
    result = run_recover(workdir, url, arm=arm, kill_rank=kill_rank, kill_after_step=kill_after_step,
                         prepared=prepared, steps=steps,
                         restore_extra=["--resume-fault", resume_fault] if resume_fault else None,
                         hosts=_hosts(on_hosts, 4, url), kill_host=kill_host)
    rows = [dict(c.measurements) for c in result.comparisons]
    m = dict(result.summary.measurements)
    emit({"summary": result.summary.id, **m, "rank_comparisons": rows}, json_out,
          _recovery_text(result.summary.id, m, rows))
    bad = [r for r in rows if not rank_passed(r)]
    if bad:
        raise divergence(bad[0])


def eval_cmd(
    workdir: WorkdirOpt = Path("experiment"),
    db: RunDbOpt = None,
    prepared: PreparedOpt = None,
    threads: Annotated[int, typer.Option(min=1, help="Intra-op threads, pinned and recorded.")] = 1,
    json_out: JsonOpt = False,
) -> None:
    """Evaluate the seed and every trained arm; append eval, paired comparison and quality receipts."""
    from ledger import digests
    from ledger.cli.render import comparisons_table, conditions_table
    from runners.evaluate import run_evaluation

    if prepared is not None:
        digests.check_digest(prepared, "--prepared")
    started = time.perf_counter()
    with err.status("evaluating", spinner="dots") if err.is_terminal else _Null() as status:
        def progress(message: str) -> None:
            if status is not None:
                status.update(message)

        result = run_evaluation(workdir, run_db(db, workdir), prepared=prepared, threads=threads,
                                progress=progress)
    summary = result.to_json()
    summary["seconds"]["wall"] = time.perf_counter() - started
    if json_out:
        emit_json(summary)
        return
    out.print(f"prepared {result.prepared}\nselection {result.selection}  (threads {result.threads})")
    evals = Table(title="evaluations", title_justify="left", show_edge=False)
    for col in ("model", "correct", "documents", "accuracy", "retention NLL", "seconds", "receipt"):
        evals.add_column(col, justify="left" if col in ("model", "receipt") else "right")
    for arm, r in result.evals.items():
        m = r.measurements
        add_row(evals, arm, str(m["correct"]), str(m["documents"]), f"{m['correct'] / m['documents']:.4f}",
                      f"{m['retention']['mean_nll']:.4f}",
                      "reused" if arm in result.reused else f"{result.seconds[f'eval/{arm}']:.1f}",
                      r.id)
    print_wide(evals)
    if result.comparisons:
        print_wide(comparisons_table({n: r.measurements for n, r in result.comparisons.items()}))
    if result.quality is not None:
        print_wide(conditions_table(result.quality.measurements["conditions"]))
        passed = result.quality.measurements["quality_contract_passed"]
        out.print(f"quality contract {'PASSED' if passed else 'FAILED'}: {result.quality.id}")
    else:
        out.print(f"quality contract not judged: arms not trained yet: {', '.join(result.missing_arms)}")
    out.print(f"{summary['seconds']['wall']:.1f}s")


def replay_cmd(
    ref: Annotated[str, typer.Argument(help="Checkpoint receipt the segment starts from.")],
    workdir: WorkdirOpt = Path("experiment"),
    db: RunDbOpt = None,
    record: Annotated[bool, typer.Option("--record", help="Append a comparison receipt of the replay.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-execute the training segment from a checkpoint to the next one (all ranks of its run) and check
    the result equals the recorded next checkpoint bit for bit (exit 1 naming rank/tensor otherwise)."""
    from runners.replay import replay

    res = replay(workdir, run_db(db, workdir), ref, record=record)
    emit(res.to_json(), json_out, "\n".join(
        [f"replayed {res.run} steps {res.from_step}..{res.to_step} on {len(res.ranks)} rank(s) in "
         f"{res.seconds:.1f}s: every rank reproduced its recorded checkpoint bit for bit"]
        + [f"  rank {r['rank']}: {r['replayed_state']}" for r in res.ranks]))


def compare_runs_cmd(
    uninterrupted: Annotated[str, typer.Argument(help="Run name (or a train-end receipt) run uninterrupted.")],
    recovered: Annotated[str, typer.Argument(help="Run name (or a train-end receipt) that was recovered.")],
    db: DbOpt = None,
    resume_step: Annotated[int | None, typer.Option(help="Compare losses after this step (default: the "
                                                    "recovered run's restore step).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Compare two runs rank by rank: model, optimizer, outer and RNG state (tensors, elements, scalars),
    file hashes, rank binding and the loss trajectory after the resume step. Exit 1 on any divergence."""
    from ledger.store import Store
    from verify.recovery import compare_runs, divergence, rank_passed

    with Store.open(db) as store:
        rows = compare_runs(store, uninterrupted, recovered, resume_step)
    if json_out:
        emit_json({"ranks": rows, "passed": all(rank_passed(r) for r in rows)})
    else:
        out.print(_ranks_text(rows))
    bad = [r for r in rows if not rank_passed(r)]
    if bad:
        raise divergence(bad[0])


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _ranks_text(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rank':>4}  {'state':<6} {'files':<6} {'binding':<8} {'losses':<8} {'model':>12} {'optimizer':>12} "
             f"{'outer':>12}  first divergence"]
    for r in rows:
        c = r["comparisons"]

        # Runs of two arms differ in components (DiLoCo has an outer optimizer, DDP has none): a component one
        # side lacks has no counts, and shows as "-".
        def elems(comp: str, c: dict[str, Any] = c) -> str:
            n = (c.get(comp) or {}).get("tensor_elements")
            return "-" if n is None else f"{n:,}"

        lines.append(f"{r['rank']:>4}  {_yes(r['contents_exactly_equal']):<6} {_yes(r['file_hashes_equal']):<6} "
                     f"{_yes(r['binding_equal']):<8} {_yes(r['trajectory_equal']):<8} {elems('model'):>12} "
                     f"{elems('optimizer'):>12} {elems('outer'):>12}  "
                     f"{_first_divergence(r)}")
    return "\n".join(lines)


def _first_divergence(r: dict[str, Any]) -> str:
    """Where a rank parts: the first differing loss (what the error names first), then the final state's first
    difference."""
    loss, state = r.get("first_trajectory_divergence"), r.get("first_state_difference")
    parts = [] if loss is None else [f"loss at step {loss}"]
    return "; ".join(parts + ([state] if state else []))


def _yes(flag: bool) -> str:
    return "equal" if flag else "DIFF"


def _recovery_text(summary: str, m: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = (f"recovery {summary}: rank {m['killed_rank']} killed after step {m['last_observed_step_before_kill']}, "
            f"failed group {m['failed_group_seconds']:.1f}s (torn down {m['detect_seconds']:.1f}s after the kill), "
            f"restored step {m['restore_step']}, restarted group {m['restarted_group_seconds']:.1f}s; all ranks "
            f"equal: {m['all_rank_state_and_trajectory_comparisons_passed']}")
    return head + "\n" + _ranks_text(rows)


def _config_steps(url: str, workdir: Path, prepared: str | None) -> int:
    from ledger.artifacts import ArtifactStore, workdir_root
    from ledger.store import Store
    from runners.prepare import load_prepared

    with Store.open(url) as store:
        digest = store.latest_prepared(prepared)
        return load_prepared(store, ArtifactStore(workdir_root(workdir)), digest).config.train.steps


def run_serve_cmd(
    workdir: WorkdirOpt = Path("experiment"),
    db: RunDbOpt = None,
    prepared: PreparedOpt = None,
    replicas: Annotated[int, typer.Option(min=2, help="Replicas on loopback ports (the failure phase kills one).")]
    = 4,
    on_hosts: HostsOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Serve the primary arm's final model from N loopback replicas (or one per namespace host), run the phases
    single, four and failure of the fixed request set, stop every replica (also on failure and Ctrl-C), and
    record replica, serve-phase and serve-summary receipts."""
    from runners.serving import run_serving

    url = run_db(db, workdir)
    result = run_serving(workdir, url, prepared=prepared, replicas=replicas,
                         progress=lambda m: err.print(m, highlight=False), hosts=_hosts(on_hosts, replicas, url))
    value = result.to_json()
    verdict = "PASSED" if value["serving_fixture_passed"] else "FAILED"
    emit(value, json_out, f"serving {value['summary']}: fixture {verdict}; four/single throughput "
         f"{value['four_throughput_ratio']:.2f}x; failure retries {value['failure_retries']}; conditions "
         + ", ".join(f"{k} {v}" for k, v in value["conditions"].items()))


def serve_cmd(
    checkpoint: Annotated[str | None, typer.Argument(help="A receipt id or prefix naming a state, or a checkpoint "
                                                          "directory (default: the primary arm's final model).")]
    = None,
    db: DbOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: the kernel chooses).")] = 8000,
    threads: Annotated[int, typer.Option(min=1, help="Intra-op threads, pinned.")] = 1,
) -> None:
    """Serve a checkpoint's model over an OpenAI-compatible HTTP API (POST /v1/completions, GET /v1/models,
    /health with the model digest the replica computed from the bytes it loaded, /metrics). The replica refuses a
    checkpoint whose bytes do not match its receipt."""
    from ledger.artifacts import ArtifactStore, default_root
    from ledger.state import read_state
    from runners.serve import serve_replica
    from runners.serving import primary_model_source, replica_spec

    with open_store(db) as store:
        arts = ArtifactStore(default_root(store.url))
        prepared = store.latest_prepared()
        if checkpoint is None:
            from runners.prepare import load_prepared

            arm = load_prepared(store, arts, prepared).config.contract.primary_arm
            source = primary_model_source(store, prepared, arm)
        elif Path(checkpoint).is_dir():
            state = read_state(Path(checkpoint))
            found = [s.receipt for s in store.find(kind="checkpoint", prepared=prepared)
                     if s.receipt.artifacts.get("state") == state.digest]
            if not found:
                from ledger.errors import InputError

                raise InputError(f"{checkpoint}: no checkpoint receipt of the latest experiment names its state "
                                 f"{state.digest}")
            source = found[-1]
        else:
            source = store.get(checkpoint).receipt
        spec = replica_spec(store, arts, prepared, source, threads=threads)
    if checkpoint is not None and Path(checkpoint).is_dir():
        import dataclasses

        spec = dataclasses.replace(spec, checkpoint=Path(checkpoint))  # serve the directory given, verified
    def listening(endpoint: str) -> None:  # once the model verified and the port is bound: the port in use
        err.print(f"serving {source.kind} {source.id} (model {spec.model_digest}) on {endpoint}", highlight=False)

    serve_replica(spec, host=host, port=port, listening=listening)
