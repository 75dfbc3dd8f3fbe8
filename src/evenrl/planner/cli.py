"""`evenrl plan`: every layout, batch and memory problem of a run, found before anything is loaded, with the fix.

    evenrl plan examples/plan_512x8.yaml --nnodes 8 --nproc-per-node 8 --device cuda --device-memory-gib 80
    evenrl plan examples/plan_512x8.yaml data.prompts_per_step=2 rollout.samples_per_prompt=1 --nproc-per-node 4
    evenrl plan CONFIG --fit             # print the nearest config that runs well on this layout, and its plan
    evenrl plan CONFIG rollout.max_staleness=1 --rollout-devices 2 --device-tflops 300   # the overlap estimate
    evenrl plan --from verl FILE [overrides] [layout flags]    # a peer's config: its failures, evenrl's equivalent

Exit codes: 0 runnable (no error finding), 1 an error finding, 2 unusable input (one line on stderr). With
--from, 0 means the evenrl equivalent is runnable: the peer's failures are what the command explains.
JSON (--json): the plan, schema "evenrl.plan/1" (its fields: evenrl.planner.plan). With --fit, plus
  "fit": {changes[{key, from, to}], config{...}, plan{evenrl.plan/1}}.
With --from, schema "evenrl.foreign/1":
  {schema, framework, file, peer_version, layout, checks[{stage, error, message, why, version}], notes[],
   keys[{key, value, status (mapped|read|not_applicable|no_equivalent|unknown), evenrl[], why, from (file|base)}],
   config{...},
   plan{evenrl.plan/1}}  (+ "fit" with --fit, as above).

This module is the top of the planner: it brings together plan (the numbers and findings), fit (the nearest
good config) and peers (other frameworks' configs). None of them imports it, and plan imports neither fit nor
peers, so the planner has no import cycle (tests/test_plan.py checks the graph).
Never imports torch (a test enforces it), so it answers on any machine in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from evenrl.config import load_config, with_settings
from evenrl.errors import ArgumentParser, UsageError
from evenrl.models.hub import resolve_models
from evenrl.planner.fit import fit, fit_verdict, minimal_yaml
from evenrl.planner.inputs import not_here
from evenrl.planner.layout import add_layout_args, has_shape_flags, layout_from_args
from evenrl.planner.peers import NAMES, read_foreign, translate
from evenrl.planner.peers.tables import STATUSES
from evenrl.planner.plan import Plan, make_plan
from evenrl.planner.render import render
from evenrl.planner.timing import add_rate_args, rate_flags


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="evenrl plan", description=__doc__.splitlines()[0])
    p.add_argument("config", help="evenrl YAML config (or the peer's file with --from)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.prompts_per_step=64")
    add_layout_args(p)
    add_rate_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema evenrl.plan/1)")
    p.add_argument("--fit", action="store_true", help="print the nearest config that runs well, and its plan")
    p.add_argument("--from", dest="framework", choices=["verl", "easyr1", "trl", "openrlhf", "slime"],
                   help="read CONFIG (the peer's config, argument file or launch script) as that framework's and "
                        "show its checks, every key's fate and evenrl's equivalent")
    p.add_argument("--peer-version", help="with --from: the peer version whose keys and checks apply "
                                          "(default: detected from the file's keys)")
    p.add_argument("--write-config", metavar="PATH",
                   help="with --from: write the equivalent evenrl config to PATH (for `evenrl train PATH`); with "
                        "--fit: the fitted config")
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_intermixed_args(argv)
    if ns.framework:
        return run_foreign(ns)
    if ns.peer_version or (ns.write_config and not ns.fit):
        raise UsageError(f"{'--peer-version' if ns.peer_version else '--write-config'}: only with --from "
                         "verl|easyr1|trl|openrlhf|slime" + ("" if ns.peer_version else " or --fit"))
    cfg = resolve_models(load_config(ns.config, ns.overrides), download=False)  # hub ids: from the local cache
    layout = layout_from_args(ns)
    plan = make_plan(cfg, layout, rates=rate_flags(ns))
    hint = ""
    if has_shape_flags(ns) and ns.device is None and not ns.nodes and layout.device == "cpu":  # e.g. planning a cluster on a laptop
        hint = "no GPU on this machine: planning CPU processes (--device cuda --device-memory-gib N plans GPUs)"
    return report(plan, as_json=ns.json, with_fit=ns.fit, title=f"evenrl plan: {ns.config}", head_text=hint,
                  write=ns.write_config and {"path": ns.write_config, "paths": {}, "source": ns.config})


def report(plan: Plan, *, as_json: bool, with_fit: bool, title: str, head: dict | None = None,
           head_text: str = "", write=None) -> int:
    """Print a plan (and with_fit: the fitted config and its plan); return the exit code. `write`: with with_fit,
    write_config's path, paths (the peer's model and data paths) and source (the file read), for the fitted config."""
    final = plan
    doc = dict(head, plan=plan.to_dict()) if head else plan.to_dict()
    text = [title, head_text, render(plan)] if head_text else [title, render(plan)]
    if with_fit:
        cfg, changes = fit(plan)
        final = make_plan(cfg, plan.layout, rates=plan.rates)
        if not final.runnable and (verdict := fit_verdict(final)):
            final.findings.append(verdict)
        written = write_config(**write, cfg=cfg, plan=final, what="the fitted config") if write else ""
        doc["fit"] = {"changes": [{"key": k, "from": a, "to": b} for k, a, b in changes],
                      "config": cfg.model_dump(mode="json"), "plan": final.to_dict()}
        done = "; ".join(f"{k} {a} -> {b}" for k, a, b in changes)
        text.append("\n--fit: " + (done or ("no change needed" if final.runnable else
                                            "no change that keeps the experiment mends this plan")))
        text.append("fitted config (keys that differ from the defaults):\n" + minimal_yaml(cfg).rstrip())
        if written:
            text.append(written)
        text.append("plan of the fitted config:\n" + render(final))
    try:
        print(json.dumps(doc, indent=1) if as_json else "\n".join(text), flush=True)
    except BrokenPipeError:  # `evenrl plan ... | head`: the reader left early; the plan itself is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if final.runnable else 1



def run_foreign(ns: argparse.Namespace) -> int:
    """`--from`: the peer's failing checks and notes, every key's fate, the equivalent evenrl config, its plan."""
    fw = ns.framework
    loaded = read_foreign(fw, ns.config, ns.overrides)
    t, cfg = translate(fw, loaded, ns)
    plan = make_plan(cfg, t.layout, rates=rate_flags(ns))
    name = NAMES[fw]
    lines = [f"{name} on {t.layout.describe()}"]
    if t.checks:
        lines.append(f"  {name} would fail {len(t.checks)} check{'s' if len(t.checks) > 1 else ''} "
                     "(in the order it meets them):")
        lines += [f"  {i}. {c.text()}" for i, c in enumerate(t.checks, 1)]
    else:
        lines.append(f"  {name} would pass its batch checks on this layout")
    lines += [f"  note: {n}" for n in t.notes]
    lines += key_lines(t.keys)
    # with --fit the fitted config is the one written (report)
    written = write_config(ns.write_config, cfg, plan, t.paths, ns.config) if ns.write_config and not ns.fit else ""
    lines.append("equivalent evenrl config (keys that differ from the defaults; any batch runs on any ranks):")
    lines.append(minimal_yaml(cfg).rstrip())
    if written:
        lines.append(written)
    lines.append("its plan:")
    head = {"schema": "evenrl.foreign/1", "framework": fw, "file": ns.config, "peer_version": t.version,
            "layout": t.layout.to_dict(), "checks": [asdict(c) for c in t.checks], "notes": t.notes,
            "keys": t.keys, "config": cfg.model_dump(mode="json")}
    return report(plan, as_json=ns.json, with_fit=ns.fit, title=f"evenrl plan --from {fw}: {ns.config}",
                  head=head, head_text="\n".join(lines),
                  write=ns.write_config and {"path": ns.write_config, "paths": t.paths, "source": ns.config})


def key_lines(keys: list[dict]) -> list[str]:
    """Every key of the peer's file with its fate: mapped beside its evenrl field, read, or why not."""
    counts = {s: sum(k["status"] == s for k in keys) for s in STATUSES}
    out = [f"every key of the file ({len(keys)}): " + ", ".join(f"{n} {s.replace('_', ' ')}"
                                                                 for s, n in counts.items() if n)]
    label = {"mapped": "", "read": "read", "not_applicable": "not applicable", "no_equivalent": "no evenrl equivalent",
             "unknown": "UNKNOWN"}
    own = [k for k in keys if k.get("from") != "base"]
    base = [k for k in keys if k.get("from") == "base"]
    for k in own:
        value = str(k["value"])
        value = value if len(value) <= 40 else value[:37] + "..."
        left = f"  {k['key']}={value}"
        why = k["why"] if k["status"] == "read" and k["why"].startswith("read") else f"{label[k['status']]}: {k['why']}"
        right = ", ".join(k["evenrl"]) if k["status"] == "mapped" else why
        out.append(f"{left:<60} -> {right}" if k["status"] == "mapped" else f"{left:<60}    {right}")
    if base:  # the base config's own keys: counted here, each listed by --json
        counts = {s: sum(k["status"] == s for k in base) for s in STATUSES}
        out.append(f"  and {len(base)} keys of the base config (its mapped values are in the config below): " +
                   ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items() if n) + "; --json lists each")
    return out


def write_config(path: str, cfg, plan: Plan, paths: dict[str, str], source: str,
                 what: str = "the equivalent config") -> str:
    """The equivalent config as a file `evenrl train` reads as is (only when the plan has no error finding), with
    the model and data paths as the user gave them, even where they are not on this machine. Never over `source`,
    the peer's file being read (under any name), nor into anything but a regular file."""
    target = Path(path)
    if target.exists() and os.path.samefile(target, source):
        raise UsageError(f"--write-config {path}: is the file being read ({source}); give another path for the "
                         "evenrl config")
    if target.exists() and not target.is_file():
        raise UsageError(f"--write-config {path}: not a regular file; give a path for the evenrl config")
    if not plan.runnable:
        raise UsageError(f"--write-config {path}: {what} has an error finding (see the plan without "
                         "--write-config); nothing written")
    cfg = with_settings(cfg, {k: v for k, v in paths.items() if not getattr(cfg, k.split(".")[0]).path})
    text = minimal_yaml(cfg)
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--write-config {path}: cannot write ({e.strerror})") from None
    missing = [f"{k}={v}" for k, v in (("model.path", cfg.model.path),) if v and not Path(v).expanduser().exists()]
    missing += [f"data.path={cfg.data.path}"] if cfg.data.path and not_here(cfg.data.path, "data.path") else []
    return f"wrote {path}" + (f"; not on this machine: {', '.join(missing)}" if missing else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
