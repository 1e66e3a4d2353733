"""The offline harness on tiny inputs whose right answers are known by construction, and the data generators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostagent.domain.assignment import Fairness
from hostagent.domain.errors import InvalidInput
from hostagent.learn import datasets, simulate
from hostagent.learn.simulate import Job, SimGpu, Table, check_inputs, run_policy

# Job "a" is 10x faster on X, job "b" 10x faster on Y; "big" needs 20 GiB, which only the Y device has.
TABLE = Table({("a", "X"): 10.0, ("a", "Y"): 1.0, ("b", "X"): 1.0, ("b", "Y"): 10.0,
               ("big", "X"): 5.0, ("big", "Y"): 5.0}, {"a": 0.0, "b": 0.0, "big": 20.0})
HOST = [SimGpu("y0", "Y", 24, 0), SimGpu("x0", "X", 16, 0)]


def _sparse_jobs(n: int) -> list[Job]:
    # arrivals far apart: both devices are free at every decision, so the best device is always available
    return [Job(i, 1000.0 * i, "a" if i % 2 == 0 else "b", 100.0, 1) for i in range(n)]


def test_oracle_and_trained_model_pick_the_fast_device_first_fit_does_not(tmp_path: Path) -> None:
    jobs = _sparse_jobs(200)
    oracle = run_policy("oracle", TABLE, HOST, jobs, seed=0, warmup_jobs=60, retrain_every=1000, min_records=40)
    # every job runs at 10/s on its device: JCT = 100 / 10
    assert all(abs(oracle.jct[j.index] - 10.0) < 1e-9 for j in jobs)
    assert max(oracle.regret.values()) == 0.0
    first = run_policy("first-fit", TABLE, HOST, jobs, seed=0, warmup_jobs=60, retrain_every=1000, min_records=40)
    # first-fit always takes y0: right for "b", 10x too slow for "a" (regret 0.9)
    assert first.jct[0] == pytest.approx(100.0) and first.regret[0] == pytest.approx(0.9)
    model = run_policy("model", TABLE, HOST, jobs, seed=0, warmup_jobs=60, retrain_every=1000, min_records=40,
                       workdir=tmp_path)
    assert model.trainings and model.trainings[0]["decision"] == "promoted"
    assert (tmp_path / "usage.db").exists()  # it learned from records written to a real store
    after = [j.index for j in jobs if j.index >= 80]
    # after training, only bounded exploration (epsilon 0.05, within 20 % of the best) may deviate: and no
    # device is within 20 % here, so every decision is right
    assert all(model.regret[i] == 0.0 for i in after)
    assert model.rules.get("model", 0) >= len(after)
    out = simulate.summarise("model", 0, model, jobs, 80)
    assert out["mean_regret"] == 0.0 and out["mean_jct_s"] == pytest.approx(10.0)


def test_short_of_labelled_records_the_model_trains_at_the_first_end_that_has_them() -> None:
    # the first job takes both devices, an X and a Y: a mixed set, whose work rate labels neither. After the 4th job
    # ends the store holds 3 labelled records (< 4): no model yet; the 5th end brings the 4th, and it trains then,
    # not after its records double (the 8th)
    jobs = [Job(0, 0.0, "a", 100.0, 2)] + _sparse_jobs(20)[1:]
    fig = run_policy("model", TABLE, HOST, jobs, seed=0, warmup_jobs=4, retrain_every=1000, min_records=4)
    assert [t["decision"] for t in fig.trainings[:2]] == ["insufficient-records", "promoted"]
    assert 3000 < fig.trainings[0]["at"] < 4000 and 4000 < fig.trainings[1]["at"] < 5000


def test_model_warm_starts_with_the_records_and_model_of_its_history(tmp_path: Path) -> None:
    history, jobs = _sparse_jobs(120), _sparse_jobs(40)
    with pytest.raises(InvalidInput, match="model-warm needs a history trace"):
        run_policy("model-warm", TABLE, HOST, jobs, seed=0, warmup_jobs=0, retrain_every=1000, min_records=40)
    cold = run_policy("model", TABLE, HOST, jobs, seed=0, warmup_jobs=40, retrain_every=1000, min_records=40)
    assert "model" not in cold.rules and cold.rules["cold-start"] > 0  # its first training comes after the 40th job
    warm = run_policy("model-warm", TABLE, HOST, jobs, seed=0, warmup_jobs=0, retrain_every=1000, min_records=40,
                      workdir=tmp_path, history=history)
    # trained on the history's records before the trace's first job (the trace's own clock: at 0 s), so no
    # decision of the trace is the cold-start rule's, and every one is right (no device is within 20 % to explore)
    assert warm.trainings[0]["at"] == 0.0 and warm.trainings[0]["decision"] == "promoted"
    assert "cold-start" not in warm.rules and warm.rules.get("model", 0) == len(jobs)
    assert max(warm.regret.values()) == 0.0 and all(v == pytest.approx(10.0) for v in warm.jct.values())
    assert set(warm.jct) == {j.index for j in jobs}  # the figures are the trace's jobs only
    # one store holds both traces' leases, each under an id of its own, the trace's clock after the history's
    import sqlite3
    with sqlite3.connect(tmp_path / "usage.db") as db:
        rows = db.execute("SELECT id, created_at FROM leases").fetchall()
    ids = {r[0] for r in rows}
    assert len(rows) == 160 and {f"sim-{i}" for i in range(120)} <= ids and {f"sim1-{i}" for i in range(40)} <= ids
    last_history = max(float(c) for i, c in rows if i.startswith("sim-"))
    assert min(float(c) for i, c in rows if i.startswith("sim1-")) > last_history + 86_000


def test_matching_oracle_cold_decides_as_models_first_day_then_knows_the_table(tmp_path: Path) -> None:
    jobs = _sparse_jobs(80)
    kw = dict(seed=3, warmup_jobs=60, retrain_every=1000, min_records=40)
    model = run_policy("model", TABLE, HOST, jobs, workdir=tmp_path, **kw)
    cold = run_policy("matching-oracle-cold", TABLE, HOST, jobs, **kw)
    first = [j.index for j in jobs if j.index < 40]  # before model's first training (after the 40th completion)
    # the same decisions as model's cold start: serve order, the cold-start rule, the warm-up's exploration
    assert [cold.jct[i] for i in first] == [model.jct[i] for i in first]
    assert [cold.regret[i] for i in first] == [model.regret[i] for i in first]
    assert max(cold.regret[i] for i in first) == pytest.approx(0.9)  # the cold start is blind to the job type
    # from then on it knows the table and explores no more: every decision is right
    assert all(cold.regret[i] == 0.0 and cold.jct[i] == pytest.approx(10.0) for i in range(40, 80))
    assert cold.rules["cold-start"] + cold.rules.get("explore", 0) == 40 and sum(cold.rules.values()) == 80
    # with no cold start (no warm-up, no records needed) it is matching-oracle itself
    assert run_policy("matching-oracle-cold", TABLE, HOST, jobs, seed=3, warmup_jobs=0, retrain_every=1000,
                      min_records=0).jct == run_policy("matching-oracle", TABLE, HOST, jobs, **kw).jct
    assert "matching-oracle-cold" in simulate.QUEUE_AWARE and "matching-oracle-cold" not in simulate.LEARNED


def test_the_first_day_backfills_behind_a_head_that_must_wait_as_the_agents_queue_does() -> None:
    # job 0 ("big", 20 GiB) holds y0 for 1000 s; job 1, also "big", heads the queue and must wait for y0; job 2 ("a")
    # arrives behind it while x0 (16 GiB, which the head can never use) is free
    jobs = [Job(0, 0.0, "big", 5000.0, 1), Job(1, 1.0, "big", 5000.0, 1), Job(2, 2.0, "a", 100.0, 1)]
    kw = dict(seed=0, warmup_jobs=1000, retrain_every=1000, min_records=1000)  # the whole trace is the first day
    for policy in ("model", "matching-oracle-cold"):
        fig = run_policy(policy, TABLE, HOST, jobs, **kw)
        assert fig.wait[2] == 0.0 and fig.jct[2] == pytest.approx(10.0)  # backfilled on x0 at once
        assert "cold-start" in fig.rules and "model" not in fig.rules
        assert fig.wait[1] == pytest.approx(999.0)  # the head was not delayed: it starts when y0 frees
    # the policies that serve in arrival order (FIFO, head of line) do not backfill
    fifo = run_policy("first-fit", TABLE, HOST, jobs, **kw)
    assert fifo.wait[2] == pytest.approx(998.0)
    # a free GPU the head could use is its own: a 2-GPU head with one of its GPUs free keeps it, since a request
    # behind it, stating no duration, is expected to hold it for leases.default_duration_s, past the head's start
    host = [SimGpu("x0", "X", 16, 0), SimGpu("x1", "X", 16, 0)]
    pair = [Job(0, 0.0, "a", 10_000.0, 1), Job(1, 1.0, "a", 1000.0, 2), Job(2, 2.0, "a", 100.0, 1)]
    fig = run_policy("matching-oracle-cold", TABLE, host, pair, **kw)
    # the head starts when job 0 ends (1000 s) and holds both for 50 s; job 2 starts after it
    assert fig.wait[1] == pytest.approx(999.0) and fig.wait[2] == pytest.approx(1048.0)


def test_once_the_queue_compares_a_head_that_cannot_start_keeps_only_what_it_could_use_as_the_agents_queue() -> None:
    # matching-oracle compares from its first job. Every request is due at once (a bound of 0 passes): job 1 ("big",
    # 20 GiB) heads the queue and cannot start while job 0 holds y0; x0 (16 GiB) it can never use. Until 2026-11-30 a
    # due request that could not start stopped every other, and job 2 waited the 1000 s for y0 with x0 free
    jobs = [Job(0, 0.0, "big", 5000.0, 1), Job(1, 1.0, "big", 5000.0, 1), Job(2, 2.0, "a", 100.0, 1)]
    kw = dict(seed=0, warmup_jobs=0, retrain_every=1000, min_records=0)
    for fairness in (Fairness(max_passes=0), Fairness()):
        fig = run_policy("matching-oracle", TABLE, HOST, jobs, fairness=fairness, **kw)
        assert fig.wait[2] == 0.0 and fig.jct[2] == pytest.approx(10.0)  # on x0 at once
        assert fig.wait[1] == pytest.approx(999.0)  # and the head starts when y0 frees
    # a free GPU the head could use is its own, as in the agent's queue (EASY backfilling): a 2-GPU head with one of
    # its GPUs free keeps it from a request behind it (which, stating no duration, would hold it past the head's
    # start); until 2026-11-30 the simulator let job 2 take it at once, which the agent would not
    host = [SimGpu("x0", "X", 16, 0), SimGpu("x1", "X", 16, 0)]
    pair = [Job(0, 0.0, "a", 10_000.0, 1), Job(1, 1.0, "a", 1000.0, 2), Job(2, 2.0, "a", 100.0, 1)]
    fig = run_policy("matching-oracle", TABLE, host, pair, **kw)
    assert fig.wait[1] == pytest.approx(999.0) and fig.wait[2] == pytest.approx(1048.0)
    # and the one behind is placed within its room, not on the GPU kept for the head: job 2 ("b", 10x faster on Y)
    # runs on x0 (16 GiB, which the 2-GPU "big" head can never use), not on the free y1 the head waits to pair
    host = [SimGpu("y0", "Y", 24, 0), SimGpu("y1", "Y", 24, 0), SimGpu("x0", "X", 16, 0)]
    kept = [Job(0, 0.0, "big", 5000.0, 1), Job(1, 1.0, "big", 1000.0, 2), Job(2, 2.0, "b", 100.0, 1)]
    fig = run_policy("matching-oracle", TABLE, host, kept, **kw)
    assert fig.wait[2] == 0.0 and fig.jct[2] == pytest.approx(100.0)  # at rate 1 on x0
    assert fig.wait[1] == pytest.approx(999.0)
    # a job behind the head with no room (another "big": only the Y GPUs fit it, and the free one is kept) is not a
    # candidate, so it does not stop one that has room: job 3 ("a") starts on x0 at once
    more = [Job(0, 0.0, "big", 5000.0, 1), Job(1, 1.0, "big", 1000.0, 2), Job(2, 2.0, "big", 100.0, 1),
            Job(3, 3.0, "a", 100.0, 1)]
    fig = run_policy("matching-oracle", TABLE, host, more, **kw)
    assert fig.wait[3] == 0.0 and fig.jct[3] == pytest.approx(10.0)
    assert fig.wait[1] == pytest.approx(999.0) and fig.wait[2] > 999.0


def test_memory_need_is_a_hard_filter_for_every_policy() -> None:
    jobs = [Job(i, 50.0 * i, "big", 50.0, 1) for i in range(30)]
    for policy in simulate.POLICIES:
        if policy in simulate.LEARNED:
            continue
        fig = run_policy(policy, TABLE, HOST, jobs, seed=1, warmup_jobs=0, retrain_every=100, min_records=10)
        assert fig.memory_violations == 0
        # only y0 fits: the jobs queue behind each other (each takes 10 s, they arrive every 50 s)
        assert all(v == pytest.approx(10.0) for v in fig.jct.values())


def test_inputs_are_checked() -> None:
    with pytest.raises(InvalidInput, match="no row for GPU model Z .*the table's are X, Y"):
        check_inputs(TABLE, [SimGpu("z", "Z", 16, 0)], [Job(0, 0, "a", 1, 1)])
    with pytest.raises(InvalidInput, match="no row for job type c"):
        check_inputs(TABLE, HOST, [Job(0, 0, "c", 1, 1)])
    kept, notes = check_inputs(TABLE, HOST, [Job(0, 0, "big", 1, 2), Job(1, 1, "a", 1, 2)])
    assert [j.job_type for j in kept] == ["a"] and "1 job(s) dropped" in notes[0]
    # a hole in the table: "b" runs only on X, so a 2-GPU "b" job cannot run on this host of one X and one Y
    holed = Table({k: v for k, v in TABLE.thr.items() if k != ("b", "Y")}, TABLE.need_gib)
    assert holed.holed == {"b"} and not holed.runs("b", "Y") and holed.runs("b", "X")
    kept, notes = check_inputs(holed, HOST, [Job(0, 0, "b", 1, 2), Job(1, 1, "b", 1, 1), Job(2, 2, "a", 1, 2)])
    assert [(j.job_type, j.num_gpus) for j in kept] == [("b", 1), ("a", 2)] and "1 job(s) dropped" in notes[0]


def test_a_table_s_holes_are_gpu_models_the_job_type_cannot_run_on(tmp_path: Path) -> None:
    # benchmark tables leave out (or give 0 for) the pairs that ran out of memory or were not measured
    (tmp_path / "t.csv").write_text("job_type,gpu_model,throughput\na,X,10\na,Y,1\nb,X,1\nb,Y,0\n")
    table = simulate.load_table(tmp_path / "t.csv")
    assert table.thr == {("a", "X"): 10.0, ("a", "Y"): 1.0, ("b", "X"): 1.0} and table.holed == {"b"}
    (tmp_path / "oom.csv").write_text("job_type,gpu_model,throughput\na,X,10\na,Y,OOM\n")
    with pytest.raises(InvalidInput, match="'OOM' is not a number; .*write 0 or leave the row out"):
        simulate.load_table(tmp_path / "oom.csv")
    (tmp_path / "neg.csv").write_text("job_type,gpu_model,throughput\na,X,-1\n")
    with pytest.raises(InvalidInput, match="must be >= 0"):
        simulate.load_table(tmp_path / "neg.csv")
    # "b" cannot run on Y at all: under every policy, the learned one included, every "b" job runs on x0 (at 1/s:
    # 100 s; jobs far apart, so none waits), though first-fit takes y0 (its first GPU) for every "a" job
    jobs = _sparse_jobs(120)
    for policy in simulate.DEFAULT_POLICIES:
        fig = run_policy(policy, table, HOST, jobs, seed=3, warmup_jobs=40, retrain_every=1000, min_records=30)
        assert all(fig.jct[j.index] == pytest.approx(100.0) for j in jobs if j.job_type == "b"), policy
        assert max(fig.regret[j.index] for j in jobs if j.job_type == "b") == 0.0, policy
    first = run_policy("first-fit", table, HOST, jobs, seed=3, warmup_jobs=40, retrain_every=1000, min_records=30)
    assert first.jct[0] == pytest.approx(100.0)  # "a" on y0, at 1/s
    # the placement code says why Y was left out: the job type's requirement, from the table
    request = simulate._request(table, jobs[1])
    decision = simulate.place(request, simulate._views(table, HOST), scorer=None)
    assert decision.chosen == ("x0",)
    assert any(gpu == "y0" and "lacks runs b (the throughput table's rows for Y)" in why
               for gpu, why in decision.dropped)
    assert simulate._request(table, jobs[0]).requires == ()  # "a" runs everywhere: no requirement


def test_names_as_published_tables_write_them_are_read_and_honoured(tmp_path: Path) -> None:
    # published tables name workloads and cards with spaces, commas, parentheses and slashes ("BERT-large, fp16" in
    # quotes, "A100 80GB PCIe"), and leave pairs out: the three CSVs read them as written, and the hole holds under
    # every policy (a BERT job runs on the A100 alone: 100 units at 10/s)
    bert, resnet = "BERT-large, fp16", "ResNet-50 (bs 64)/v1.5"
    (tmp_path / "t.csv").write_text(f'job_type,gpu_model,throughput,memory_gib\n"{bert}",A100 80GB PCIe,10,8\n'
                                    f'"{resnet}",A100 80GB PCIe,1,8\n"{resnet}",V100-SXM2 16GB,10,8\n')
    (tmp_path / "h.csv").write_text("gpu_id,gpu_model,memory_gib,numa_node,health_factor\n"
                                    "v0,V100-SXM2 16GB,16,0,1\na0,A100 80GB PCIe,80,0,1\n")
    (tmp_path / "r.csv").write_text("arrival_s,job_type,work,num_gpus,priority\n" + "".join(
        f'{1000 * i},"{bert if i % 2 else resnet}",100,1,0\n' for i in range(120)))
    table, host = simulate.load_table(tmp_path / "t.csv"), simulate.load_host(tmp_path / "h.csv")
    jobs, _ = check_inputs(table, host, simulate.load_trace(tmp_path / "r.csv"))
    assert table.holed == {bert} and {j.job_type for j in jobs} == {bert, resnet} and len(jobs) == 120
    assert [g.model for g in host] == ["V100-SXM2 16GB", "A100 80GB PCIe"]
    for policy in simulate.DEFAULT_POLICIES:
        fig = run_policy(policy, table, host, jobs, seed=3, warmup_jobs=40, retrain_every=1000, min_records=30)
        assert all(fig.jct[j.index] == pytest.approx(10.0) for j in jobs if j.job_type == bert), policy
    model = run_policy("model", table, host, jobs, seed=3, warmup_jobs=40, retrain_every=1000, min_records=30)
    assert any(t["decision"] == "promoted" for t in model.trainings)  # it learnt from these names too


def test_cli_reads_the_three_csvs_and_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.csv").write_text("job_type,gpu_model,throughput,memory_gib\n"
                                    + "".join(f"{j},{m},{t},{TABLE.need_gib[j]}\n" for (j, m), t in TABLE.thr.items()))
    (tmp_path / "h.csv").write_text("gpu_id,gpu_model,memory_gib,numa_node,health_factor\ny0,Y,24,0,1\nx0,X,16,0,1\n")
    (tmp_path / "r.csv").write_text("arrival_s,job_type,work,num_gpus,priority\n"
                                    + "".join(f"{j.arrival_s},{j.job_type},{j.work},1,0\n" for j in _sparse_jobs(40)))
    rc = simulate.main(["--throughputs", str(tmp_path / "t.csv"), "--host", str(tmp_path / "h.csv"),
                        "--trace", str(tmp_path / "r.csv"), "--seeds", "2", "--policies", "oracle,first-fit",
                        "--warmup-jobs", "10", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"policy", "seed", "mean_jct_s", "p99_jct_s", "makespan_s", "mean_regret", "memory_violations",
            "mean_wait_s", "p99_wait_s", "max_wait_s"}
    assert len(out["results"]) == 4 and all(set(r) == keys for r in out["results"])
    oracle = [r for r in out["results"] if r["policy"] == "oracle"]
    assert all(r["mean_jct_s"] == pytest.approx(10.0) and r["mean_regret"] == 0.0 for r in oracle)
    assert simulate.main(["--throughputs", str(tmp_path / "missing.csv"), "--host", "h", "--trace", "r"]) == 2
    # model-warm needs the trace whose records its store starts with; given it, it is right from the first job
    warm = ["--throughputs", str(tmp_path / "t.csv"), "--host", str(tmp_path / "h.csv"), "--trace",
            str(tmp_path / "r.csv"), "--seeds", "1", "--policies", "model-warm", "--warmup-jobs", "0", "--json"]
    capsys.readouterr()
    assert simulate.main(warm) == 2 and "model-warm needs --history-trace" in capsys.readouterr().err
    assert simulate.main(warm + ["--history-trace", str(tmp_path / "r.csv"), "--min-records", "20"]) == 0
    [run] = json.loads(capsys.readouterr().out)["results"]
    assert run["policy"] == "model-warm" and run["mean_regret"] == 0.0 and run["mean_jct_s"] == pytest.approx(10.0)


def test_generators_from_a_small_copy_of_the_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sia").mkdir(parents=True)
    (data / "alibaba_v2023").mkdir()
    (data / "sia" / "sia_single_gpu_summary.csv").write_text(
        "model,gpu_type,max_local_bsz,best_samples_per_sec,n,gpu_desc\n"
        "bert,aws,12,13.0,5,T4\nbert,dgx,12,70.0,5,A100\nbert,dgx-ext,48,140.0,9,A100\n"
        "ncf,aws,32768,1500.0,21,T4\nncf,dgx,32768,3000.0,21,A100\n"
        + "".join(f"{j},{g},8,{t},3,x\n" for j in ("bert", "ncf") for g, t in (("azure", 40), ("quad", 30), ("rtx", 20))))
    (data / "sia" / "philly_jobs.csv").write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + "".join(
        f"2017-10-01 00:{i // 60:02d}:{i % 60:02d},{60 + 10 * i},{1 + i % 2},0,c\n" for i in range(100)))
    (data / "alibaba_v2023" / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,8,T4\nn1,1,1,2,P100\n")
    table = datasets.sia_table(datasets.data_dir(data))
    got = {(r["job_type"], r["gpu_model"]): r["throughput"] for r in table}
    assert got[("bert", "A100")] == 140.0 and got[("bert", "T4")] == 13.0 and got[("ncf", "RTX2080Ti")] == 20.0
    assert len(got) == 10
    host = datasets.host_from_mix("T4:1,A100:1")
    assert [(h["gpu_model"], h["memory_gib"], h["numa_node"]) for h in host] == [("T4", 16, 0), ("A100", 40, 1)]
    assert set(datasets.alibaba_mix(data, 10, 0).replace(":", ",").split(",")[::2]) <= {"T4", "P100"}
    trace = datasets.philly_trace(data, table, host, jobs=50, load=0.5, seed=0)
    assert len(trace) == 50 and {r["num_gpus"] for r in trace} <= {1, 2}
    # offered load, measured back from the trace, is what was asked for
    rate = {j: 2 / (1 / next(float(r["throughput"]) for r in table if r["job_type"] == j and r["gpu_model"] == "T4")
                    + 1 / next(float(r["throughput"]) for r in table if r["job_type"] == j and r["gpu_model"] == "A100"))
            for j in ("bert", "ncf")}
    busy = sum(float(r["work"]) / rate[str(r["job_type"])] * int(r["num_gpus"]) for r in trace)  # type: ignore[arg-type]
    span = float(trace[-1]["arrival_s"])  # type: ignore[arg-type]
    assert busy / (span * 2) == pytest.approx(0.5, rel=1e-6)
    with pytest.raises(InvalidInput, match="no sia/ folder"):
        datasets.data_dir(tmp_path / "nowhere")
    with pytest.raises(InvalidInput, match="no throughput for GPU model V100"):
        datasets.philly_trace(data, table[:2], datasets.host_from_mix("V100:1"), jobs=10, load=0.5, seed=0)
    # a pair the table leaves out is one the job type cannot run on: a type no GPU of the host runs is not drawn,
    # and the load is that of the GPUs each type can run on
    holed = [r for r in table if not (r["job_type"] == "ncf" and r["gpu_model"] in ("A100", "T4"))]
    trace = datasets.philly_trace(data, holed, host, jobs=50, load=0.5, seed=0)
    assert {r["job_type"] for r in trace} == {"bert"}
    busy = sum(float(r["work"]) / rate["bert"] * int(r["num_gpus"]) for r in trace)  # type: ignore[arg-type]
    assert busy / (float(trace[-1]["arrival_s"]) * 2) == pytest.approx(0.5, rel=1e-6)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="no job type of the table can run on any GPU of this host"):
        datasets.philly_trace(data, [{**r, "memory_gib": 64} for r in table], host, jobs=10, load=0.5, seed=0)
    assert datasets.main(["--data", str(data), "all", "--out", str(tmp_path / "out"), "--jobs", "40"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "alibaba_host.csv", "roofline_host.csv", "roofline_table.csv", "roofline_trace.csv", "sia_host.csv",
        "sia_table.csv", "sia_trace.csv", "synthetic_table.csv", "synthetic_trace.csv"]


def test_noisy_oracle_is_the_table_off_by_a_few_per_cent_drawn_once_per_run() -> None:
    import math
    import random

    assert "noisy-oracle" in simulate.POLICIES and "noisy-oracle" in simulate.QUEUE_AWARE
    table = Table({(f"j{i}", m): 10.0 + i for i in range(20) for m in ("X", "Y")}, {})
    views = [simulate.DeviceView(gpu_id=g.gpu_id, model=g.model) for g in HOST]

    def errors(seed: int) -> list[float]:
        sc = simulate.rule_scorers(table, HOST, random.Random(0), noise_rng=random.Random(seed))["noisy-oracle"]
        out = []
        for i in range(20):
            got = sc.score(simulate.PlacementRequest(task_type=f"j{i}"), views)
            out += [math.log(v / table.thr[(f"j{i}", g.model)]) for v, g in zip(got, HOST)]
        return out

    e = errors(1)
    assert e == errors(1) and e != errors(2)  # one draw per run, from the run's seed
    assert all(abs(x) < 6 * simulate.ORACLE_NOISE for x in e) and max(abs(x) for x in e) > 0.2 * simulate.ORACLE_NOISE
    sd = (sum(x * x for x in e) / len(e)) ** 0.5
    assert 0.5 * simulate.ORACLE_NOISE < sd < 1.5 * simulate.ORACLE_NOISE
    # the other policies' draws do not move with it (its own generator): `random` scores as before it existed
    r = simulate.PlacementRequest(task_type="j0")
    plain = simulate.rule_scorers(table, HOST, random.Random(7))["random"]
    beside = simulate.rule_scorers(table, HOST, random.Random(7), noise_rng=random.Random(5))["random"]
    assert [plain.score(r, views) for _ in range(5)] == [beside.score(r, views) for _ in range(5)]
    jobs = _sparse_jobs(40)
    noisy = run_policy("noisy-oracle", TABLE, HOST, jobs, seed=0, warmup_jobs=0, retrain_every=1000, min_records=40)
    assert all(abs(noisy.jct[j.index] - 10.0) < 1e-9 for j in jobs)  # tenfold differences survive a 3 % error


def test_a_job_that_cannot_run_on_the_free_gpu_does_not_hold_up_one_behind_it_that_can() -> None:
    # "b" cannot run on Y. x0 is busy with a "b" job for 100 s when a second one arrives, then "big" (only y0 has
    # its 20 GiB): the second "b" must wait for x0, and "big" starts on y0 at once, both on the first day (the serve
    # order's backfilling) and once the queue compares (matching-oracle)
    table = Table({k: v for k, v in TABLE.thr.items() if k != ("b", "Y")}, TABLE.need_gib)
    jobs = [Job(0, 0.0, "b", 100.0, 1), Job(1, 1.0, "b", 10.0, 1), Job(2, 2.0, "big", 50.0, 1)]
    for policy in ("model", "matching-oracle"):
        fig = run_policy(policy, table, HOST, jobs, seed=0, warmup_jobs=0, retrain_every=100, min_records=50)
        assert fig.wait[0] == 0.0 and fig.wait[2] == 0.0, policy
        assert fig.jct[2] == pytest.approx(10.0) and fig.wait[1] == pytest.approx(99.0), policy


def test_the_synthetic_table_may_leave_pairs_out(tmp_path: Path) -> None:
    models = ["T4", "V100", "A100", "P100", "A10", "L4"]
    full = datasets.synthetic_table(3, models, 12)
    holed = datasets.synthetic_table(3, models, 12, holes=0.3)
    assert len(full) == 72 and 30 < len(holed) < 72
    assert all(r in full for r in holed)  # the rows kept are the full table's, to the digit
    assert {r["job_type"] for r in holed} == {f"job{k}" for k in range(12)}  # every job type keeps a model
    assert datasets.synthetic_table(3, models, 12, holes=0.0) == full
    # nearly every pair drawn out: a job type that would lose them all keeps its fastest model
    pair = datasets.synthetic_table(1, ["T4", "V100"], 12)
    sparse = datasets.synthetic_table(1, ["T4", "V100"], 12, holes=0.99)
    assert sorted(r["job_type"] for r in sparse) == sorted(f"job{k}" for k in range(12))
    assert sparse == [max((r for r in pair if r["job_type"] == f"job{k}"), key=lambda r: float(str(r["throughput"])))
                      for k in range(12)]
    with pytest.raises(InvalidInput, match="--holes must be in"):
        datasets.synthetic_table(3, models, 12, holes=1.0)
    assert datasets.main(["synthetic-table", "--out", str(tmp_path / "t.csv"), "--models", ",".join(models),
                          "--job-types", "12", "--seed", "3", "--holes", "0.3"]) == 0
    table = simulate.load_table(tmp_path / "t.csv")
    assert len(table.thr) == len(holed) and table.holed


def test_a_host_mix_takes_any_gpu_model_with_its_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a model the data sets have no figure for is given with its memory; a name that carries its size, or one the
    # agent knows, needs none; the data sets' own models as before
    host = datasets.host_from_mix("K80:2:12,A100 80GB:1,Tesla P40,V100:1")
    assert [(h["gpu_model"], h["memory_gib"]) for h in host] == [("K80", 12), ("K80", 12), ("A100 80GB", 80),
                                                                 ("Tesla P40", 24), ("V100", 32)]
    assert datasets.host_from_mix("T4:1:15.5")[0]["memory_gib"] == 15.5  # the figure given wins
    for bad, says in (("K80:2", "give it as K80:2:MEMORY_GIB"), ("T4:x", "COUNT is a whole number"),
                      ("T4:1:big", "MEMORY_GIB a number"), ("T4:0", "above 0"), ("T4:1:0", "above 0"),
                      ("T4:1:16:2", "MODEL:COUNT or MODEL:COUNT:MEMORY_GIB"), (":2", "MODEL:COUNT")):
        with pytest.raises(InvalidInput, match=says):
            datasets.host_from_mix(bad)
    # through the command line: a clear error, exit 2 and no file; the file it writes is one the harness runs
    out = tmp_path / "host.csv"
    assert datasets.main(["host", "--out", str(out), "--mix", "K80:2"]) == 2 and not out.exists()
    assert "give it as K80:2:MEMORY_GIB" in capsys.readouterr().err
    assert datasets.main(["host", "--out", str(out), "--mix", "K80:2:12,V100:2"]) == 0
    table = tmp_path / "table.csv"
    table.write_text("job_type,gpu_model,throughput,memory_gib\nresnet,K80,10,8\nresnet,V100,80,8\n"
                     "lm,K80,5,16\nlm,V100,40,16\n")
    host_rows = simulate.load_host(out)
    assert [(g.model, g.memory_gib) for g in host_rows] == [("K80", 12.0)] * 2 + [("V100", 32.0)] * 2
    jobs = [Job(i, float(i), "lm" if i % 2 else "resnet", 100.0, 1) for i in range(8)]
    fig = run_policy("first-fit", simulate.load_table(table), host_rows, jobs, seed=0, warmup_jobs=0,
                     retrain_every=500, min_records=100)
    assert len(fig.jct) == 8 and fig.memory_violations == 0  # lm (16 GiB) never on a 12 GiB K80
