"""`eyrie plan` counts turns done and left from prompt shards and partial logs, and says how sure it is."""

from __future__ import annotations

import math

import pytest

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie import config as cfg
from eyrie.generation.conversations import settings_key
from eyrie.generation.partial import PartialLog
from eyrie.plan import build_plan, format_plan
from eyrie.target.model import model_fingerprint


def setup(tmp_path):
    config = cfg.validate(
        {
            "model": {"name": "m", "path": "model"},
            "datasets": {"d": {"source": {"file": "x.jsonl"}, "shards": 2, "limit": 100, "heldout_fraction": 0.0}},
            "generation": {"max_turns": 2},
            "plan": {"guess_tokens_per_second": 10, "guess_completion_tokens": 200},
        }
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return config


def write_prompts(tmp_path, shard, turns_by_id):
    rows = [{"id": pid, "n_user_turns": n} for pid, n in turns_by_id.items()]
    path = tmp_path / f"results/prompts/d/{shard}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def row(pid, turn, reason="stop", tokens=100, seconds=1.0):
    return {"id": pid, "turn": turn, "user": "u", "reply": "r", "finish_reason": reason, "prompt_tokens": 5, "completion_tokens": tokens, "seconds": seconds}


def test_before_anything_ran_the_plan_uses_the_guesses(tmp_path):
    table, summary = build_plan(setup(tmp_path), tmp_path)
    assert list(table["state"]) == ["waiting for prompts"] * 2
    # 100 prompts / 2 shards x 2 turns x (200 / 2) tokens per turn at 10 tokens/s
    assert summary["hours_left"] == 100 * 2 * 100 / 10 / 3600
    assert summary["hours_low"] < summary["hours_left"] < summary["hours_high"]
    assert "guessed" in format_plan(table, summary)


def test_a_synthetic_datasets_prompts_are_planned_from_its_count_before_they_exist(tmp_path):
    """No limit, no prompt file yet: a synthetic source still says how many prompts it gives (count, held-out share
    off), each one user turn; a file source without a limit stays unknown."""
    config = setup(tmp_path)
    config["datasets"] = cfg.validate({**config, "datasets": {
        "syn": {"source": {"synthetic": {"count": 300}}, "shards": 2, "heldout_fraction": 0.1},
        "capped": {"source": {"synthetic": {"count": 300}}, "shards": 1, "limit": 50, "heldout_fraction": 0.0},
        "file": {"source": {"file": "x.jsonl"}, "shards": 1},
        "rework": {"source": {"file": "x.jsonl"}, "rework": {}, "shards": 1, "limit": 40, "heldout_fraction": 0.0},
    }})["datasets"]
    table, summary = build_plan(config, tmp_path)
    by = {(r["dataset"], r["shard"]): r for r in table.to_dict("records")}
    # a rework dataset's prompts are one user turn each, whatever generation.max_turns (2 here) says
    assert by[("rework", "0000")]["prompts"] == "~40" and by[("rework", "0000")]["hours_left"] == 40 * 1 * 100 / 10 / 3600
    assert [by[("syn", s)]["prompts"] for s in ("0000", "0001")] == ["~135", "~135"] and by[("capped", "0000")]["prompts"] == "~50"
    # 135 prompts x 1 turn x (200 / 2) guessed tokens per turn at 10 tokens/s
    assert by[("syn", "0000")]["hours_left"] == 135 * 1 * 100 / 10 / 3600
    assert by[("file", "0000")]["prompts"] == "?" and math.isnan(by[("file", "0000")]["hours_left"])  # pandas holds None as NaN


def test_the_plan_says_what_a_synthetic_datasets_sampling_has_left():
    """Before a batch: the most batches it can take and no time; after some: the batches left at the kept rate so far,
    and their time at the seconds per batch measured; with the count reached, nothing left."""
    from eyrie.plan import synthesis_line

    settings = cfg.validate({"model": {"name": "m", "path": "model"},
                             "datasets": {"s": {"source": {"synthetic": {"count": 3000, "batch_size": 1024}}}}})["datasets"]["s"]["source"]["synthetic"]
    assert synthesis_line("s", settings, None) == (
        "s: synthesis not started: 3,000 prompts wanted, at most 12 batches of 1,024 samples of up to 256 tokens; "
        "its time is known once a batch is drawn")
    done = {"batches": 2, "samples": 2048, "kept": 1536, "full": False, "seconds_per_batch": 9.0}  # 75% kept
    # (3000 - 1536) / 0.75 = 1952 more samples: 2 batches of 1,024, 18 s
    assert synthesis_line("s", settings, done) == (
        "s: synthesis: 2 batches drawn, 1,536 of 3,000 prompts kept from 2,048 samples (75% kept); ~2 batches left at that rate, "
        "~18 s at the 9.0 s per batch measured")
    slow = synthesis_line("s", settings, {**done, "batches": 1, "seconds_per_batch": 4000.0})
    assert slow.startswith("s: synthesis: 1 batch drawn,") and slow.endswith("~2.2 h at the 4000.0 s per batch measured")
    assert "the count is reached" in synthesis_line("s", settings, {**done, "kept": 3000, "full": True})
    untimed = synthesis_line("s", settings, {**done, "seconds_per_batch": None})
    assert untimed.endswith("~2 batches left at that rate")


def test_partial_logs_count_finished_turns_but_not_error_rows(tmp_path):
    config = setup(tmp_path)
    write_prompts(tmp_path, "0000", {"a": 2, "b": 1, "c": 3, "e": 1})
    write_prompts(tmp_path, "0001", {"x": 1})
    key = settings_key(cfg.generation_settings(config, "d"), model_fingerprint(tmp_path / "model"))
    PartialLog(tmp_path / f"results/partial/completions/d/0000/{key}.jsonl").append(
        [row("a", 0, tokens=80), row("a", 1, tokens=120), row("b", 0, "prompt_too_long", 0, 0.0), row("c", 0, tokens=100), row("e", 0, "error", 0, 0.5)]
    )
    table, summary = build_plan(config, tmp_path)
    first = table.iloc[0]
    assert first["state"] == "partial"
    assert first["done"] == 2  # a (both turns) and b (ended by a too-long prompt); c has 1 of 2 turns; e errored
    assert first["turns_left"] == (2 + 1 + 2 + 1) - 4  # c's second turn and e's turn remain
    assert first["tokens_left"] == 2 * 100  # mean reply 100 tokens per answered turn
    assert summary["measured"] and summary["tokens_per_second"] == 300 / 3.0
    text = format_plan(table, summary)
    assert "measured on 3 finished turns" in text and "90% range" in text


def test_a_dataset_that_keeps_its_source_replies_takes_no_generation_time_and_leaves_the_rate_alone(tmp_path):
    config = setup(tmp_path)
    config["datasets"]["kept"] = cfg.validate({**config, "datasets": {
        "kept": {"source": {"file": "x.jsonl"}, "replies": "source", "shards": 1, "limit": 40, "heldout_fraction": 0.0}}})["datasets"]["kept"]
    fingerprint = model_fingerprint(tmp_path / "model")
    write_prompts(tmp_path, "0000", {"a": 2, "c": 2})
    PartialLog(tmp_path / f"results/partial/completions/d/0000/{settings_key(cfg.generation_settings(config, 'd'), fingerprint)}.jsonl").append(
        [row("a", 0, tokens=80), row("a", 1, tokens=120)])
    kept_log = tmp_path / f"results/partial/completions/kept/0000/{settings_key(cfg.generation_settings(config, 'kept'), fingerprint)}.jsonl"
    PartialLog(kept_log).append([row("k", 0, tokens=500, seconds=0.0)])  # counted in no seconds, as the source engine writes
    table, summary = build_plan(config, tmp_path)
    by = {(r["dataset"], r["shard"]): r for r in table.to_dict("records")}
    assert summary["tokens_per_second"] == 200 / 2.0  # the generated turns' rate alone
    assert by[("kept", "0000")]["hours_left"] == by[("kept", "0000")]["hours_high"] == 0.0
    assert by[("kept", "0000")]["tokens_left"] > 0 and by[("d", "0000")]["hours_left"] > 0


def test_planned_outputs_list_every_file_in_build_order_and_mark_a_temporary_cache(tmp_path):
    from eyrie.plan import planned_outputs

    config = setup(tmp_path)
    planned = planned_outputs(config)
    paths = [p.path for p in planned]
    assert paths[-1] == "report.html" and paths.index("results/drafter") > paths.index("results/hidden/d/0001.safetensors")
    # One job per shard writes its tokens and its cache, both from the shard's completions.
    assert {p.path for p in planned if p.rule == "extract_hidden"} == {"results/tokens/d/0000.parquet", "results/tokens/d/0001.parquet",
                                                                       "results/hidden/d/0000.safetensors", "results/hidden/d/0001.safetensors"}
    assert {p.path: p.inputs for p in planned if p.rule == "extract_hidden"}["results/hidden/d/0001.safetensors"] == ("results/completions/d/0001.parquet",)
    assert all(p.kept for p in planned)
    # No held-out prompts: no benchmark of this dataset; the wheel benchmarks come from the bench section's defaults.
    assert [p.path for p in planned if p.path.startswith("results/bench/")] == ["results/bench/humaneval.json", "results/bench/mtbench.json"]

    config["hidden"]["keep"] = False
    planned = {p.path: p for p in planned_outputs(config)}
    assert not planned["results/hidden/d/0000.safetensors"].kept
    assert not any(i.startswith("results/hidden/") for i in planned["results/drafter"].inputs + planned["report.html"].inputs)


def test_eyrie_plan_ends_with_the_hidden_cache_against_the_free_disk(tmp_path, monkeypatch, capsys):
    import json
    import shutil

    import yaml

    from eyrie.cli import main

    config = setup(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({k: config[k] for k in ("model", "datasets", "generation", "plan")}))
    # 100 prompts x (200 completion + 200 prompt tokens) at 32,773 bytes per token: about 1.3 GB against 1 GB free.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**10, 0, 10**9))
    assert main(["plan", "--config", str(tmp_path / "config.yaml"), "-d", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    section = text[text.index("hidden-state cache (hidden.dtype bfloat16, hidden.keep true):"):]
    assert "tokens:      ~40,000 (estimated, no token shard yet: 100 samples (datasets.d.limit) x 400 tokens per sample" in section
    assert "bytes/token: 32,773 (H = 4,096 from model/config.json)" in section
    assert "free space:  953.7 MiB" in section and "the cache does not fit" in section
    assert "hidden.dtype: float8_e4m3fn: about half the bytes (625.8 MiB instead of 1.2 GiB)" in section


def test_the_plan_reads_a_partial_log_without_changing_it_even_with_a_torn_last_line(tmp_path):
    """A job may be appending while `eyrie plan` reads: a torn last line (a write under way) is not counted and the
    file's bytes stay as they are (the job's own reread repairs a tail torn by a kill)."""
    config = setup(tmp_path)
    write_prompts(tmp_path, "0000", {"a": 2, "b": 1})
    log = PartialLog(tmp_path / f"results/partial/completions/d/0000/{settings_key(cfg.generation_settings(config, 'd'), model_fingerprint(tmp_path / 'model'))}.jsonl")
    log.append([row("a", 0, tokens=80)])
    with open(log.path, "ab") as f:
        f.write(b'{"id": "a", "turn": 1, "user": "u", "rep')  # the writer's next line, half written
    before = log.path.read_bytes()
    table, _ = build_plan(config, tmp_path)
    assert log.path.read_bytes() == before
    assert table.iloc[0]["state"] == "partial" and table.iloc[0]["turns_left"] == 3 - 1
    assert list(log.read()) == [("a", 0)] and log.path.read_bytes() == before
    # The owner's read cuts the torn tail; the finished line stays.
    assert list(log.load()) == [("a", 0)] and log.path.read_bytes() == before[: before.rindex(b"\n") + 1]


def test_the_plan_reads_the_log_a_served_model_wrote(tmp_path):
    from eyrie.generation.partial import log_path

    config = setup(tmp_path)
    write_prompts(tmp_path, "0000", {"a": 2})
    key = settings_key(cfg.generation_settings(config, "d"), model_fingerprint(tmp_path / "model"))
    PartialLog(log_path(tmp_path / "results/partial/completions/d/0000", key, "served1234")).append([row("a", 0)])
    table, _ = build_plan(config, tmp_path)
    assert table.iloc[0]["state"] == "partial" and table.iloc[0]["turns_left"] == 1


def test_a_shard_whose_job_runs_shows_in_progress_before_its_first_turn(tmp_path):
    import base64

    config = setup(tmp_path)
    write_prompts(tmp_path, "0000", {"a": 1})
    marker = tmp_path / ".snakemake/incomplete" / base64.urlsafe_b64encode(b"results/completions/d/0000.parquet").decode()
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    (tmp_path / ".snakemake/locks").mkdir()
    (tmp_path / ".snakemake/locks/0.output.lock").write_text("")
    table, _ = build_plan(config, tmp_path)
    assert list(table["state"]) == ["in progress", "waiting for prompts"]
    (tmp_path / ".snakemake/locks/0.output.lock").unlink()  # the run is gone, its marker stayed
    table, _ = build_plan(config, tmp_path)
    assert table.iloc[0]["state"].startswith("interrupted")


def test_the_cache_fits_for_the_plan_exactly_when_the_extract_jobs_accept_it(tmp_path, monkeypatch):
    """The plan's fit check keeps the job's 64 MiB margin (one function, eyrie.hidden.size.has_room): a cache far under
    the free space but within the margin of it does not fit, as each extract_hidden job refuses its shard."""
    import json
    import shutil

    from eyrie.hidden.size import MARGIN_BYTES, CacheTooLargeError, ensure_room, estimate_cache, format_estimate

    config = setup(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    shards = [("d", "0000"), ("d", "0001")]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**10, 0, 10**12))
    total = estimate_cache(config, tmp_path, shards, "model").to_write
    assert 0 < total < MARGIN_BYTES  # small: the headroom share alone would call it a fit
    for free, fits in ((total + MARGIN_BYTES // 2, False), (total + MARGIN_BYTES, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: shutil._ntuple_diskusage(10**10, 0, free))
        estimate = estimate_cache(config, tmp_path, shards, "model")
        assert estimate.fits is fits and total <= 0.9 * free
        text = format_estimate(estimate)
        assert ("margin each extract_hidden job keeps" in text) is (not fits) and ("fits:" in text) is fits
        # A job's check on one shard of the cache on the same disk: refused exactly when the plan says no.
        if fits:
            ensure_room(tmp_path / "hidden.safetensors", total // 2, "bfloat16")
        else:
            with pytest.raises(CacheTooLargeError):
                ensure_room(tmp_path / "hidden.safetensors", total // 2, "bfloat16")
