"""The fidelity study's report: markdown tables and the figure, from `fidelity_stats.summarise`'s output.

Headline comparison: the default predictive rule (topk_kl, proportional estimator) against DPPO, which
has the same proximity test and the ratio rule's direction, so their difference is the direction test
alone. Every other rule is reported the same way. Knows nothing of models or of how runs are made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from fidelity_stats import DESIGNS, verdict

HEADLINE_RULE = "predictive/proportional"
# (label, where in a design's block, key of the pooled per-seed difference, +1 if the paper claims
# higher for predictive, −1 if lower)
HEADLINE = (
    ("agreement on far tokens", ("diff", HEADLINE_RULE, "agree_far"), f"{HEADLINE_RULE}:agree_far", +1),
    (
        "right on the disagreement set, predictive − ratio",
        ("disagreement", "proportional", "pred_minus_ratio"),
        "disagreement/proportional",
        +1,
    ),
    ("unsafe-keep", ("diff", HEADLINE_RULE, "unsafe_keep"), f"{HEADLINE_RULE}:unsafe_keep", -1),
    ("wrong-mask", ("diff", HEADLINE_RULE, "wrong_mask"), f"{HEADLINE_RULE}:wrong_mask", -1),
)
DECOMPOSITION_COLUMNS = (
    ("predictive~logit", "P̂ vs logit"),
    ("ratio~logit", "ratio vs logit"),
    ("predictive~own", "P̂ vs own"),
    ("ratio~own", "ratio vs own"),
    ("predictive~own|disagree", "P̂ vs own, where rules disagree"),
    ("own~batch", "own vs batch"),
    ("own~batch|kept", "own vs batch, kept"),
    ("batch~real", "batch vs real"),
    ("predictive~real", "P̂ vs real"),
    ("ratio~real", "ratio vs real"),
)


def fmt_ci(ci: Mapping[str, float], *, signed: bool = True, digits: int = 3) -> str:
    if not ci or not math.isfinite(ci.get("mean", math.nan)):
        return "n/a"
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    return f"{f.format(ci['mean'])} [{f.format(ci['lo'])}, {f.format(ci['hi'])}]"


def _get(summary: Mapping, path: tuple[str, ...]) -> Mapping[str, float]:
    x = summary
    for p in path:
        x = x.get(p, {})
    return x


def verdict_table(summary: Mapping, design: str) -> str:
    """Setting × headline metric: paired difference (predictive − DPPO), 95 % interval, verdict."""
    lines = [
        "| setting | seeds | far tokens | " + " | ".join(h[0] for h in HEADLINE) + " |",
        "|---|---|---|" + "---|" * len(HEADLINE),
    ]
    for name, s in summary["settings"].items():
        cells = [
            f"{fmt_ci(c := _get(s[design], path))} {verdict(c, better)}" for _, path, _, better in HEADLINE
        ]
        lines.append(f"| {name} | {len(s['seeds'])} | {s['far_frac']:.1%} | " + " | ".join(cells) + " |")
    pooled = summary.get("all_settings_diff", {})
    if pooled:
        cells = []
        for _, _, key, better in HEADLINE:
            c = pooled.get(f"{design}:{key}", {})
            cells.append(f"{fmt_ci(c)} {verdict(c, better)}")
        lines.append("| all settings (per-seed mean) | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rules_table(name: str, s: Mapping, design: str) -> str:
    """One setting and design: every rule's rates (mean over seeds) and its paired difference from DPPO."""
    metrics = ("agree_far", "unsafe_keep", "wrong_mask", "mask_frac")
    block = s[design]
    lines = [
        f"**{name}, {design} step** — {len(s['seeds'])} seeds, {s['tokens']} response tokens, "
        f"{s['far_frac']:.1%} far",
        "",
        "| rule | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for rule, rates in block["rules"].items():
        cells = []
        for m in metrics:
            d = block["diff"].get(rule, {}).get(m)
            extra = f" (Δ {fmt_ci(d)})" if d else ""
            cells.append(f"{rates[m]['mean']:.3f}{extra}")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| estimator | disagreement, % of far | predictive right there | predictive − ratio |",
        "|---|---|---|---|",
    ]
    for est, row in block["disagreement"].items():
        lines.append(
            f"| {est} | {row['dis_frac']['mean']:.1%} | {fmt_ci(row['pred_right'], signed=False)} | "
            f"{fmt_ci(row['pred_minus_ratio'])} |"
        )
    return "\n".join(lines)


def decomposition_table(summary: Mapping) -> str:
    """Sign agreement on the sampled far tokens (mean over seeds, 95 % interval)."""
    lines = [
        "| setting | tokens | " + " | ".join(label for _, label in DECOMPOSITION_COLUMNS) + " |",
        "|---|---|" + "---|" * len(DECOMPOSITION_COLUMNS),
    ]
    for name, s in summary["settings"].items():
        d = s["decomposition"]
        cells = [fmt_ci(d.get(k, {}), signed=False, digits=2) for k, _ in DECOMPOSITION_COLUMNS]
        lines.append(f"| {name} | {s['decomposition_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(summary: Mapping, header: str) -> str:
    parts = [header]
    for design, what in DESIGNS.items():
        parts += [
            f"### Paired differences, default predictive − DPPO, {design} step ({what}); "
            "mean over seeds [95 % bootstrap interval]",
            verdict_table(summary, design),
        ]
    for design in DESIGNS:
        parts += [
            f"### Every rule, per setting, {design} step",
            *(rules_table(name, s, design) for name, s in summary["settings"].items()),
        ]
    parts += ["### Error decomposition: sign agreement on sampled far tokens", decomposition_table(summary)]
    return "\n\n".join(parts) + "\n"


COLORS = {
    "ppo": "0.45",
    "predictive/proportional": "C0",
    "predictive/uniform": "C1",
    "predictive/aggregated": "C2",
}
SHARED = f"{HEADLINE_RULE}, shared step"  # the figure's hollow series: the other design, headline rule
COLORS[SHARED] = "C3"
DECOMPOSITION_BARS = (
    ("predictive~logit", "P̂ ~ logit"),
    ("ratio~logit", "ratio ~ logit"),
    ("predictive~own", "P̂ ~ own"),
    ("ratio~own", "ratio ~ own"),
    ("own~batch", "own ~ batch"),
    ("batch~real", "batch ~ real"),
    ("predictive~real", "P̂ ~ real"),
    ("ratio~real", "ratio ~ real"),
)


def _forest(ax, summary: Mapping, series: list[tuple[str, object]], title: str) -> None:
    """One point with its 95 % interval per (setting, series); settings top to bottom."""
    settings = list(summary["settings"])
    for j, (rule, get) in enumerate(series):
        ys = [i + 0.18 * (j - (len(series) - 1) / 2) for i in range(len(settings))]
        cis = [get(summary["settings"][s]) for s in settings]
        xs = [c["mean"] for c in cis]
        err = [[c["mean"] - c["lo"] for c in cis], [c["hi"] - c["mean"] for c in cis]]
        hollow = {"mfc": "none"} if rule == SHARED else {}
        ax.errorbar(xs, ys, xerr=err, fmt="o", ms=4, capsize=2, color=COLORS.get(rule), label=rule, **hollow)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(settings)), settings)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)


def figure(summary: Mapping, path: Path) -> None:
    """Forest plots of the paired differences (every predictive estimator, and PPO, minus DPPO) per
    setting — each rule on its own step, and the headline rule on the shared step hollow — and the
    decomposition's sign-agreement rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(summary["settings"])
    rules = list(next(iter(summary["settings"].values()))["own"]["diff"])
    fig, axes = plt.subplots(2, 3, figsize=(15, 2 * (0.45 * len(settings) + 1.6)))
    axes = axes.ravel()
    for ax, (metric, title) in zip(
        axes,
        (
            ("agree_far", "agreement on far tokens, rule − DPPO (paper: > 0)"),
            ("unsafe_keep", "unsafe-keep, rule − DPPO (paper: < 0)"),
            ("wrong_mask", "wrong-mask, rule − DPPO (paper: < 0)"),
        ),
        strict=False,
    ):
        # PPO's direction is the ratio's: its agreement equals DPPO's by construction.
        shown = [r for r in rules if not (metric == "agree_far" and r == "ppo")]
        series = [(r, lambda s, r=r, m=metric: s["own"]["diff"][r][m]) for r in shown]
        series.append((SHARED, lambda s, m=metric: s["shared"]["diff"][HEADLINE_RULE][m]))
        _forest(ax, summary, series, title)
        if metric == "wrong_mask":  # PPO's difference is ten times the others': keep both readable
            ax.set_xscale("symlog", linthresh=0.01)
            ax.set_title(title + ", symlog", fontsize=9)
    estimators = [r.split("/", 1)[1] for r in rules if r.startswith("predictive/")]
    _forest(
        axes[3],
        summary,
        [
            (f"predictive/{e}", lambda s, e=e: s["own"]["disagreement"][e]["pred_minus_ratio"])
            for e in estimators
        ]
        + [(SHARED, lambda s: s["shared"]["disagreement"]["proportional"]["pred_minus_ratio"])],
        "right on the disagreement set, predictive − ratio (paper: > 0)",
    )
    ax = axes[4]
    width = 0.8 / len(DECOMPOSITION_BARS)
    for j, (k, label) in enumerate(DECOMPOSITION_BARS):
        vals = [summary["settings"][s]["decomposition"].get(k, {}).get("mean", math.nan) for s in settings]
        ys = [i + width * (j - (len(DECOMPOSITION_BARS) - 1) / 2) for i in range(len(settings))]
        ax.barh(ys, vals, height=width, label=label)
    ax.axvline(0.5, color="k", lw=0.8, ls=":")
    ax.set_yticks(range(len(settings)), settings)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_title("decomposition: sign agreement on sampled far tokens (0.5 = chance)", fontsize=9)
    axes[5].axis("off")
    axes[5].legend(
        *axes[1].get_legend_handles_labels(), loc="upper left", title="rule − DPPO, own step", fontsize=8
    )
    axes[5].add_artist(axes[5].get_legend())
    axes[5].legend(*ax.get_legend_handles_labels(), loc="lower right", title="decomposition", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- learning curves ---------------------------------------------------------------------------------


def curves_markdown(summary: Mapping, title: str) -> str:
    """Held-out accuracy per rule and step (mean over seeds [95 % interval]), the gain, and each rule's
    paired difference from DPPO."""
    rules = list(summary["rules"])
    steps = sorted({int(s) for r in rules for s in summary["rules"][r]})
    lines = [title, "", "| rule | " + " | ".join(f"step {s}" for s in steps) + " | gain (last − 0) |"]
    lines.append("|---|" + "---|" * (len(steps) + 1))
    for r in rules:
        cells = [
            fmt_ci(summary["rules"][r].get(s, summary["rules"][r].get(str(s), {})), signed=False, digits=2)
            for s in steps
        ]
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {fmt_ci(summary['gain'][r], digits=2)} |")
    lines += ["", "| rule − DPPO | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines.append("|---|" + "---|" * len(steps))
    for r, by_step in summary["diff"].items():
        cells = [fmt_ci(by_step.get(s, by_step.get(str(s), {})), digits=2) for s in steps]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curves_figure(summary: Mapping, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r, by_step in summary["rules"].items():
        steps = sorted(by_step, key=int)
        x = [int(s) for s in steps]
        mean = [by_step[s]["mean"] for s in steps]
        ax.plot(x, mean, marker="o", label=r)
        ax.fill_between(x, [by_step[s]["lo"] for s in steps], [by_step[s]["hi"] for s in steps], alpha=0.15)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("SmolLM2-135M (4-bit, dequantised), arithmetic")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
