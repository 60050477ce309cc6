"""Turn the bench's raw epochs into medians, ratios, target checks, a table and a plot."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORDER = {
    "local": 0,
    "shardfs": 1,
    "shardfs-shard": 2,
    "shardfs-uniform": 3,
    "webdataset": 4,
    "ratarmount": 5,
    "local+dl": 6,
    "local+warm": 7,
}
# "-": a local epoch with the page cache warm; "dropped": one right after drop_caches.
EPOCH_ORDER = {"-": 0, "dropped": 1, "cold": 2, "warm": 3, "recached": 4, "remount": 5}
METRICS = (
    "images_per_s",
    "mb_per_s",
    "egress_bytes",
    "daemon_cpu_s",
    "daemon_peak_rss_mb",
    "mount_s",
    "mount_egress_bytes",
    "waited_share_after_first_shard",
    "waited_share_of_images",
)


SHARED_TEXT = (
    "Shared-core context (not the targets): the same paired decode epochs with every process "
    "on every core, the server among the readers, as the bench ran before it pinned. moto "
    "spends far more CPU per request than S3 costs a client, so on shared cores these rows "
    "measure the server as much as the loader."
)
SHUFFLE_MODEL = (
    "The model rows are computed, not measured. With `shuffle=True` every DataLoader worker "
    "asks for one uniformly random sample at a time, so until most of a cold dataset has "
    "arrived nearly every read waits for the network. The model takes an epoch through any "
    "filesystem to cost the download of the dataset at the server's peak plus the same "
    "epoch on local disk, with no overlap: its two inputs are measured in this run, their "
    "sum is not. webdataset is outside the model: it reads in shard order through a "
    "shuffle buffer, which is not a uniform shuffle."
)
MIN_PAIRS = 5
PAIRS_TEXT = (
    "Paired targets: local and streaming epochs alternate in one bench process (a local "
    "epoch with the same seed right before each shardfs and webdataset epoch; before each "
    "cold one, first a local epoch right after `drop_caches`, then the warm local one; and "
    "a fresh peak measurement right before each raw cold one); 'measured' is the median of "
    "the per-pair ratios and 'range' their min-max. 'local after drop_caches' is the local "
    "epoch read from disk: a cold shardfs epoch at 1.0 of it does what a cold local disk "
    f"does. A target is met when the median clears it over at least {MIN_PAIRS} pairs; "
    "'within noise' when the range straddles the goal."
)


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def pair_ratios(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-pair ratios of one row's epochs: images/s over the local epoch run right before
    (``vs_local``, page cache warm) and over the local one run right after drop_caches
    before that (``vs_local_dropped``), and MB/s over the peak measured right before
    (``vs_peak``)."""
    ratios: dict[str, list[float]] = {"vs_local": [], "vs_local_dropped": [], "vs_peak": []}
    for record in records:
        if record.get("pair_local_images_per_s"):
            ratios["vs_local"].append(record["images_per_s"] / record["pair_local_images_per_s"])
        if record.get("pair_local_dropped_images_per_s"):
            ratios["vs_local_dropped"].append(
                record["images_per_s"] / record["pair_local_dropped_images_per_s"]
            )
        if record.get("pair_peak_mb_per_s"):
            ratios["vs_peak"].append(record["mb_per_s"] / record["pair_peak_mb_per_s"])
    return ratios


def paired_verdict(spread: dict[str, float] | None, goal: float) -> tuple[bool | None, str]:
    """(met, the words for the table) for per-pair ratios that must reach ``goal``."""
    if spread is None:
        return None, "—"
    if spread["n"] < MIN_PAIRS:
        return False, f"**no**: {spread['n']:.0f} pairs, {MIN_PAIRS} needed"
    met = spread["median"] >= goal
    words = "yes" if met else "**no**"
    if spread["min"] < goal <= spread["max"]:
        words += ", within noise"
    return met, words


def spread_of(values: list[float]) -> dict[str, float] | None:
    """Median, min, max and count of ``values``; None when there are none."""
    return _spread(values) if values else None


def within_verdict(
    spread: dict[str, float] | None, center: float, tolerance: float
) -> tuple[bool | None, str]:
    """(met, the words for the table) for per-pair ratios whose median must lie within
    ``tolerance`` of ``center`` (``|median - center| <= tolerance``) over ``MIN_PAIRS``."""
    if spread is None:
        return None, "—"
    if spread["n"] < MIN_PAIRS:
        return False, f"**no**: {spread['n']:.0f} pairs, {MIN_PAIRS} needed"
    met = abs(spread["median"] - center) <= tolerance
    words = "yes" if met else "**no**"
    low, high = center - tolerance, center + tolerance
    inside = low <= spread["min"] and spread["max"] <= high
    outside = spread["max"] < low or spread["min"] > high
    if not inside and not outside:  # some pairs in the band, some out
        words += ", within noise"
    return met, words


def target_row(
    name: str, value: float | None, spread: dict[str, float] | None, goal: str,
    met: bool | None, verdict: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One target's row; ``met`` None: not measured in this run (a contender skipped)."""
    verdict = verdict or {True: "yes", False: "**no**", None: "—"}[met]
    return {"target": name, "value": value, "range": spread, "goal": goal, "met": met,
            "verdict": verdict}  # fmt: skip


def num(value: float | None, digits: int = 2) -> str:
    """A table cell: ``value`` with ``digits`` decimals and thousands commas, — for None."""
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def target_table(checks: list[dict[str, Any]], digits: int = 2) -> list[str]:
    """The markdown table of ``target_row`` rows: measured, min-max (n), goal, verdict."""
    lines = ["| target | measured | range | goal | met |", "|---|---|---|---|---|"]
    for check in checks:
        s = check["range"]
        span = f"{s['min']:.{digits}f}-{s['max']:.{digits}f} ({s['n']:.0f})" if s else "—"
        lines.append(f"| {check['target']} | {num(check['value'], digits)} | {span} "
                     f"| {check['goal']} | {check['verdict']} |")  # fmt: skip
    return lines


def summary_lines(checks: list[dict[str, Any]], digits: int = 2) -> list[str]:
    """One PASS / FAIL (SKIP: not measured) line per ``target_row`` row, for the terminal."""
    word = {True: "PASS", False: "FAIL", None: "SKIP"}
    return [f"{word[c['met']]} {c['target']}: {num(c['value'], digits)} (goal {c['goal']})"
            for c in checks]  # fmt: skip


def write_section(
    result: dict[str, Any], out: Path, name: str,
    ratios: Callable[[dict[str, Any]], dict[str, dict[int, float]]],
    checks: Callable[[dict[str, Any], dict[str, dict[int, float]]], list[dict[str, Any]]],
    markdown: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:  # fmt: skip
    """NAME.json and NAME.md in ``out`` for a section with per-round ratios and targets;
    the result with its ``ratios`` and ``targets``."""
    by_round = ratios(result)
    result = {**result, "ratios": by_round, "targets": checks(result, by_round)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    return result


def summarise(epochs: list[dict[str, Any]], cores: str = "shared") -> list[dict[str, Any]]:
    """One row per contender, mode, workers, epoch and cores ("pinned" or "shared"; records
    without one ran under ``cores``)."""
    groups: dict[tuple[str, str, int, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in epochs:
        key = (record["contender"], record["mode"], record["workers"], record["epoch"])
        groups[(*key, record.get("cores", cores))].append(record)
    rows = []
    for (contender, mode, workers, epoch, where), records in groups.items():
        row: dict[str, Any] = {
            "contender": contender,
            "mode": mode,
            "workers": workers,
            "epoch": epoch,
            "cores": where,
            "runs": len(records),
        }
        for metric in METRICS:
            values = [r[metric] for r in records if r.get(metric) is not None]
            if values:
                row[metric] = _spread(values)
        for name, ratios in pair_ratios(records).items():
            if ratios:
                row[f"pair_{name}"] = _spread(ratios)
        rows.append(row)
    local = {
        (r["mode"], r["workers"], r["cores"]): r["images_per_s"]["median"]
        for r in rows
        if r["contender"] == "local" and r["epoch"] == "-"
    }
    for row in rows:
        base = local.get((row["mode"], row["workers"], row["cores"]))
        row["vs_local"] = row["images_per_s"]["median"] / base if base else None
    rows.sort(
        key=lambda r: (
            r["cores"] != cores,
            r["mode"],
            r["workers"],
            ORDER.get(r["contender"], 9),
            EPOCH_ORDER[r["epoch"]],
        )
    )
    return rows


AGAINST = {
    "vs_local": "images/s / local",
    "vs_local_dropped": "images/s / local after drop_caches",
    "vs_peak": "MB/s / server peak",
}


def _find(rows: list[dict[str, Any]], contender: str, mode: str, workers: int, epoch: str) -> Any:
    for row in rows:
        if (row["contender"], row["mode"], row["workers"], row["epoch"]) == (
            contender,
            mode,
            workers,
            epoch,
        ):
            return row
    return None


class Checks:
    """The target table as it is built: plain checks and checks on paired ratios."""

    def __init__(self, rows: list[dict[str, Any]], workers: int) -> None:
        self.rows, self.workers = rows, workers
        self.checks: list[dict[str, Any]] = []

    def add(self, name: str, value: float | None, goal: str, ok: bool | None) -> None:
        verdict = {True: "yes", False: "**no**", None: "—"}[ok]
        self.checks.append(
            {"target": name, "value": value, "goal": goal, "met": ok, "verdict": verdict}
        )

    def paired(
        self, contender: str, mode: str, epoch: str, against: str, goal: float | None
    ) -> None:
        """A goal on the row's per-pair ratios (``against``: a key of ``AGAINST``); with
        ``goal`` None a context row (no verdict), left out if the row did not run."""
        row = _find(self.rows, contender, mode, self.workers, epoch)
        spread = row.get(f"pair_{against}") if row else None
        if goal is None:
            met, verdict = None, "—"
            if spread is None:
                return
        else:
            met, verdict = paired_verdict(spread, goal)
            if row is not None and spread is None:
                met, verdict = False, "**no**: no paired runs"
        context = "" if goal is not None else ", context"
        self.checks.append(
            {
                "target": f"{mode} w{self.workers} {contender} {epoch} {AGAINST[against]} "
                f"(paired{context})",
                "value": None if spread is None else spread["median"],
                "range": spread,
                "goal": "—" if goal is None else f">= {goal}",
                "met": met,
                "verdict": verdict,
            }
        )


def targets(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The project's goals, each with the measured value and whether it is met: ratios to
    local disk and to the server's peak from paired runs, the rest from the run's rows."""
    workers = 2
    table = Checks(rows, workers)
    add, paired = table.add, table.paired
    dataset = result["dataset"]["shard_bytes"]
    peak = result["server"]["peak_mb_per_s"]

    images = result["dataset"]["images"]
    download_s = dataset / (peak * 1e6)  # the whole dataset at the server's peak
    paired("shardfs", "decode", "cold", "vs_local", 0.95)
    paired("shardfs", "decode", "cold", "vs_local_dropped", None)
    paired("shardfs", "decode", "warm", "vs_local", 0.98)
    paired("local", "decode", "dropped", "vs_local", None)

    def local_seconds(mode: str) -> float | None:
        local = _find(rows, "local", mode, workers, "-")
        return images / local["images_per_s"]["median"] if local else None

    decode_s = local_seconds("decode")
    if decode_s is not None:
        add(
            f"decode w{workers}: model (not measured) of a cold epoch read in shuffled order, "
            "local / (local + dataset / server peak), no overlap (context, see below)",
            decode_s / (decode_s + download_s),
            "—",
            None,
        )
    ceiling = _find(rows, "local+dl", "decode", workers, "-")
    if ceiling is not None:
        add(
            f"decode w{workers} local while curl downloads the shards / local: the ceiling "
            "for any downloading loader here (context)",
            ceiling["vs_local"],
            "—",
            None,
        )
    paired("shardfs", "raw", "warm", "vs_local", 0.5)
    paired("shardfs", "raw", "cold", "vs_peak", 0.85)
    raw_s = local_seconds("raw")
    if raw_s is not None:
        add(
            f"raw w{workers}: model (not measured) of a cold epoch read in shuffled order, "
            "(dataset / server peak) / (that + local), no overlap (context, see below)",
            download_s / (download_s + raw_s),
            "—",
            None,
        )
    sampler_targets(table)
    cold = [r for r in rows if r["contender"] == "shardfs" and r["epoch"] == "cold"]
    if cold:
        worst = max(r["egress_bytes"]["max"] for r in cold) / dataset
        add("shardfs egress epoch 1 / dataset bytes (worst run)", worst, "<= 1.05", worst <= 1.05)
    for epoch in ("warm", "remount"):
        runs = [r for r in rows if r["contender"] == "shardfs" and r["epoch"] == epoch]
        if runs:
            worst = max(r["egress_bytes"]["max"] for r in runs)
            add(f"shardfs egress {epoch} (bytes, worst run)", worst, "== 0", worst == 0)
    fill = result.get("prefetch_all")
    if fill is not None:
        ratio = fill["ratio_to_ideal"]
        add(
            "--prefetch all: cache full after mount ready / (dataset / server peak)",
            ratio,
            "<= 1.2",
            ratio <= 1.2,
        )
        with_mount = fill["median_with_mount_s"] / fill["ideal_s"]
        add("--prefetch all, mount start included / ideal (context)", with_mount, "—", None)
    ratio = result["warm_all"]["ratio_to_ideal"]
    add("`shardfs warm` end to end / ideal (context)", ratio, "—", None)
    misplaced = sum(1 for r in result["epochs"] if r.get("misplaced"))
    if "pinning" in result:
        add("epochs with a process off its cores (server, epoch runner, daemon)",
            misplaced, "== 0", misplaced == 0)  # fmt: skip
    return table.checks


def sampler_targets(table: Checks) -> None:
    """Issue 11's targets for ``ShardSampler`` (contenders shardfs-shard, shardfs-uniform)."""
    rows, workers, add, paired = table.rows, table.workers, table.add, table.paired
    # Issue 21's goals with the server pinned (shard cold also against a cold local disk).
    for contender, epoch, against, goal in (
        ("shardfs-shard", "cold", "vs_local", 0.95),
        ("shardfs-shard", "cold", "vs_local_dropped", 1.0),
        ("shardfs-shard", "warm", "vs_local", 0.98),
        ("shardfs-shard", "recached", "vs_local_dropped", None),
        ("shardfs-shard", "recached", "vs_local", None),
        ("shardfs-uniform", "cold", "vs_local", 0.93),
        ("shardfs-uniform", "cold", "vs_local_dropped", None),
        ("webdataset", "cold", "vs_local", None),
        ("webdataset", "cold", "vs_local_dropped", None),
        ("webdataset", "warm", "vs_local", None),
    ):
        paired(contender, "decode", epoch, against, goal)
    ceiling = _find(rows, "local+dl", "decode", workers, "-")
    uniform = _find(rows, "shardfs-uniform", "decode", workers, "cold")
    if ceiling is not None and uniform is not None:
        value = uniform["images_per_s"]["median"] / ceiling["images_per_s"]["median"]
        add(
            f"decode w{workers} shardfs-uniform cold / local+dl ceiling (context, unpaired)",
            value,
            "—",
            None,
        )
    own = _find(rows, "local+warm", "decode", workers, "-")
    if own is not None:
        add(
            f"decode w{workers} local while `shardfs warm` downloads the shards / local: the "
            "ceiling with shardfs's own fetch path, its CPU taken from the epoch's cores "
            "(context)",
            own["vs_local"],
            "—",
            None,
        )
        for contender in ("shardfs", "shardfs-shard", "shardfs-uniform"):
            cold = _find(rows, contender, "decode", workers, "cold")
            if cold is not None:
                value = cold["images_per_s"]["median"] / own["images_per_s"]["median"]
                add(
                    f"decode w{workers} {contender} cold / local+warm ceiling (context, unpaired)",
                    value,
                    "—",
                    None,
                )
    paired("shardfs-shard", "raw", "cold", "vs_peak", 0.85)
    for contender in ("shardfs-shard", "shardfs-uniform"):
        runs = [r for r in rows if r["contender"] == contender and r["epoch"] == "cold"]
        shares = [r["waited_share_of_images"]["max"] for r in runs if "waited_share_of_images" in r]
        if shares:
            add(
                f"{contender} cold: reads waited on the network / images read, whole epoch "
                "(bounds the share after the first shard; worst run, all modes and workers)",
                max(shares),
                "<= 0.02",
                max(shares) <= 0.02,
            )
        after = [
            r["waited_share_after_first_shard"]["max"]
            for r in runs
            if "waited_share_after_first_shard" in r
        ]
        if after:
            add(
                f"{contender} cold: waited / hinted daemon READs after the first shard (worst "
                "run; context: most files are pushed to the page cache and never reach the "
                "daemon as READs)",
                max(after),
                "—",
                None,
            )


def _prefetch_all_text(result: dict[str, Any]) -> str:
    fill = result.get("prefetch_all")
    if fill is None:
        return ""
    return (
        f" `mount --prefetch all`: cache full {fill['median_fill_s']:.1f} s after the mount "
        f"was ready ({fill['ratio_to_ideal']:.2f}x), {fill['median_with_mount_s']:.1f} s "
        "counting the mount."
    )


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _range(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "—"
    return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _cores_text(result: dict[str, Any]) -> str:
    pinning = result.get("pinning")
    if pinning is None:
        return "not recorded (every process on every core, as before pinning)."
    text = f"{pinning['label']}."
    if pinning["pinned"]:
        text += (
            " The store's CPU is not the node's, as on a training node reading S3; the "
            "moto server keeps every object in memory, so `drop_caches` drops only the "
            "node's pages."
        )
    return text


def _rows_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| contender | mode | workers | epoch | images/s | MB/s | vs local | paired / local "
        "| paired / dropped | egress MB | mount egress MB | daemon CPU s | daemon peak RSS MB "
        "| waited / images | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:

        def med(metric: str, row: dict[str, Any] = row) -> float | None:
            return row[metric]["median"] if metric in row else None

        egress, mount_egress = med("egress_bytes"), med("mount_egress_bytes")
        lines.append(
            f"| {row['contender']} | {row['mode']} | {row['workers']} | {row['epoch']} "
            f"| {_fmt(med('images_per_s'))} | {_fmt(med('mb_per_s'), 1)} "
            f"| {_fmt(row['vs_local'], 2)} | {_range(row.get('pair_vs_local'))} "
            f"| {_range(row.get('pair_vs_local_dropped'))} "
            f"| {_fmt(None if egress is None else egress / 1e6, 1)} "
            f"| {_fmt(None if mount_egress is None else mount_egress / 1e6, 1)} "
            f"| {_fmt(med('daemon_cpu_s'), 1)} | {_fmt(med('daemon_peak_rss_mb'))} "
            f"| {_pct(med('waited_share_of_images'))} | {row['runs']} |"
        )
    return lines


def markdown(
    result: dict[str, Any],
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    context: list[dict[str, Any]] | None = None,
) -> str:
    """The report: the run's rows and targets, then ``context`` rows (shared cores)."""
    meta = result["dataset"]
    peak = result["server"]["peak_mb_per_s"]
    warm = result["warm_all"]
    lines = [
        f"Cores: {_cores_text(result)}",
        "",
        f"Dataset: {meta['images']} JPEGs ({meta['mean_image_bytes'] / 1e3:.0f} KB mean, "
        f"{meta['classes']} classes) in {meta['shards']} shards, "
        f"{meta['shard_bytes'] / 1e6:.0f} MB; moto S3 on loopback; server peak "
        f"{peak:.0f} MB/s (8 MiB ranged GETs, by threads: "
        + ", ".join(
            f"{t}: {v:.0f}"
            for t, v in result["server"]["peak_runs"][0]["mb_per_s_by_threads"].items()
        )
        + f"). `shardfs warm`: {warm['median_s']:.1f} s end to end vs ideal "
        f"{warm['ideal_s']:.1f} s ({warm['ratio_to_ideal']:.2f}x)."
        + _prefetch_all_text(result)
        + " DataLoader(shuffle, batch 32), medians of n runs; 'paired / local': the median "
        "(min-max) of each epoch's images/s over the local epoch run right before it, "
        "'paired / dropped' over the local epoch run right after `drop_caches` before that "
        "(cold and recached epochs; local 'dropped' is that epoch, paired with the warm one "
        "after it). 'egress MB' is counted during the epoch, 'mount egress MB' while "
        "mounting (before the epoch; the warm row shares its cold row's mount). "
        "shardfs-shard and shardfs-uniform: the same mount read through "
        "`ShardSampler(mode=...)`; shardfs-shard 'recached': its third epoch, the page cache "
        "dropped first (every file read back from the cache's blocks); 'waited / "
        "images' is `shardfs stats` reads_waited_on_network over the images read in the "
        "epoch (files pushed to the page cache never reach the daemon, so never wait).",
        "",
        "",
        *_rows_table(rows),
    ]
    mounts = [r for r in rows if "mount_s" in r and r["workers"] == rows[0]["workers"]]
    seen = set()
    for row in mounts:
        key = (row["contender"], row["epoch"])
        if key in seen:
            continue
        seen.add(key)
        fetched = row["mount_egress_bytes"]["median"] / 1e6
        lead = "" if len(seen) > 1 else "\n"
        lines.append(
            f"{lead}- mount before {row['contender']} {row['epoch']}: "
            f"{row['mount_s']['median']:.1f}"
            f" s, {fetched:.1f} MB fetched (not in the epoch's egress)"
        )
    lines += [
        "",
        "| target | measured | range (pairs) | goal | met |",
        "|---|---|---|---|---|",
    ]
    for check in checks:
        value = check["value"]
        shown = "—" if value is None else (f"{value:,.0f}" if value > 100 else f"{value:.2f}")
        spread = check.get("range")
        pairs = "—"
        if spread is not None:
            pairs = f"{spread['min']:.2f}-{spread['max']:.2f} ({spread['n']})"
        lines.append(
            f"| {check['target']} | {shown} | {pairs} | {check['goal']} | {check['verdict']} |"
        )
    lines += ["", PAIRS_TEXT, "", SHUFFLE_MODEL]
    if context:
        lines += ["", SHARED_TEXT, "", *_rows_table(context)]
    if "small_cache" in result:
        from small_cache import markdown as small_cache_markdown

        small = result["small_cache"]
        lines += ["", small_cache_markdown(small, small["targets"]).rstrip("\n")]
    if result["notes"]:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in result["notes"]]
    lines += ["", f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min)."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["mode"], r["workers"]) for r in rows})
    series = sorted(
        {(r["contender"], r["epoch"]) for r in rows},
        key=lambda s: (ORDER.get(s[0], 9), EPOCH_ORDER[s[1]]),
    )
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), squeeze=False)
    for ax, (mode, workers) in zip(axes[0], groups, strict=False):
        labels, values, errors = [], [], []
        for contender, epoch in series:
            row = _find(rows, contender, mode, workers, epoch)
            if row is None:
                continue
            spread = row["images_per_s"]
            labels.append(contender if epoch == "-" else f"{contender}\n{epoch}")
            values.append(spread["median"])
            errors.append([spread["median"] - spread["min"], spread["max"] - spread["median"]])
        colors = [f"C{ORDER.get(label.split(chr(10))[0], 9)}" for label in labels]
        ax.bar(
            range(len(values)),
            values,
            color=colors,
            yerr=list(zip(*errors, strict=True)) if errors else None,
            capsize=3,
        )
        ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{mode}, {workers} workers")
        ax.set_ylabel("images/s (median, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def split_rows(result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The summary rows of the run's own setting (the targets' rows), and the others: the
    shared-core context rows of a pinned run."""
    pinning = result.get("pinning")
    cores = "pinned" if pinning and pinning["pinned"] else "shared"
    rows = summarise(result["epochs"], cores)
    return [r for r in rows if r["cores"] == cores], [r for r in rows if r["cores"] != cores]


def write_reports(result: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    rows, context = split_rows(result)
    checks = targets(result, rows)
    result = {**result, "summary": rows, "shared_context": context, "targets": checks}
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result, rows, checks, context)
    (out / "bench.md").write_text(table)
    try:
        plot(rows, out / "bench.png")
    except ImportError:  # matplotlib comes with `make bench-deps`
        print("bench: matplotlib is not installed; no bench.png", flush=True)
    return table
