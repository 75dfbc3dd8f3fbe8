"""A peer's launch script read as text, never executed: the trainer's command line and the layout it asks for.

verl, EasyR1 and Logic-RL users run `bash run_*.sh`: `python3 -m verl.trainer.main_ppo key=value ...` after shell
variables; OpenRLHF's scripts build `--flags` in bash arrays and hand them to `ray job submit -- python3 -m
openrlhf.cli.train_ppo_ray`, sometimes inside `srun ... bash -c "..."`; TRL's run through `accelerate launch` or
`trl grpo`. This module reads that much bash and no more: assignments (`export`, arrays, `${VAR:-default}`,
`$((arithmetic))`), line continuations, quoting, comments, heredocs, if/elif/else (it takes the branch the
script's own values select, and says which), the script's arguments (`$@`, `$1`: unknown here, named in a note),
and the wrappers around the trainer (env assignments, srun, ray job submit, bash -c, torchrun, accelerate launch,
nohup, pipes and redirections). Loops, functions and case blocks are skipped: they start workers, not trainers.
Tokens are shlex's (the standard library's); only what shlex cannot do is here: branches, and expansion against the
script's variables (peers.expand).
Command substitutions `$(...)` are never run: a value that needs one stays unresolved and is named. Reading is
bounded (peers.shell: value length, nesting, steps of work): a script past a bound is one line, not a hang.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from evenrl.errors import UsageError
from evenrl.planner.peers.expand import Variables
from evenrl.planner.peers.shell import (MAX_CHARS, TooMuch, balanced_parens, condition, open_quote, statements,
                                        strip_comment, tokens)

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
_ARRAY_OPEN = re.compile(r"^\s*(?:(?:export|local|declare(?:\s+-[a-zA-Z]+)*|readonly)\s+)?([A-Za-z_]\w*)=\((.*)$", re.S)
# any peer's trainer (a module or script name), when the caller names none (peers/data/<peer>.yaml: each one's own)
TRAINERS = re.compile(r"(verl\.trainer\.main|recipe\.[\w.]*main|main_ppo|main_dapo|main_grpo|train_ppo_ray|"
                      r"openrlhf\.cli\.|grpo|ppo|rloo|trl$|(^|/)train(_async)?\.py$)")


@dataclass
class Launch:
    """The trainer command a script runs, as the trainer would receive its arguments."""
    program: str = ""  # e.g. "python3 -m verl.trainer.main_ppo", "accelerate launch src/open_r1/grpo.py"
    args: list[str] = field(default_factory=list)
    nnodes: int | None = None  # from #SBATCH / srun --nodes, accelerate --num_machines, torchrun --nnodes
    gpus_per_node: int | None = None  # from --gres=gpu:N / --gpus-per-node
    num_processes: int | None = None  # accelerate --num_processes (over all its machines)
    num_machines: int | None = None  # accelerate --num_machines
    launcher_config: str = ""  # accelerate --config_file
    launcher: dict = field(default_factory=dict)  # that file's settings, where it (or TRL's bundled copy) is read
    notes: list[str] = field(default_factory=list)
    unresolved: set[str] = field(default_factory=set)  # variables the script leaves to its caller
    server: list[str] = field(default_factory=list)  # the arguments of a `trl vllm-serve` the script starts
    ran: list[str] = field(default_factory=list)  # programs the script runs that are not the trainer asked for
    commands: list[str] = field(default_factory=list)  # every command's name (a script, not a bare list of flags)


def looks_like_script(text: str) -> bool:
    """A shell launch script rather than YAML/JSON or a bare list of flags."""
    return bool(re.search(r"(^#!|\bpython3?\b|\btorchrun\b|\baccelerate\s+launch\b|\btrl\s+\w|\bsrun\b|"
                          r"^\s*(export\s+)?[A-Za-z_]\w*=|\$\{?[A-Za-z_@*0-9])", text, re.M))


def read_script(text: str, source: str = "the launch script", trainer: re.Pattern = TRAINERS) -> Launch:
    """The trainer command of a launch script (the first one whose module or script `trainer` matches, when it
    runs several). A script that passes a bound of peers.shell is a one-line UsageError naming `source`."""
    state = _State(trainer)
    try:
        for line in _logical_lines(text, state):  # on past the trainer: a `trl vllm-serve` it talks to
            state.line(line)
    except TooMuch as e:
        raise UsageError(f"{source}: {e}; evenrl reads a launch script as text, not as a program: write the "
                         "trainer's arguments plainly (or give its config file)") from None
    out = state.launch
    if state.unset:
        names = ", ".join(f"${n}" for n in sorted(state.unset))
        where = "its caller's environment, or a file it sources" if state.sourced else "its caller's environment"
        out.notes.append(f"not set in the script ({where}): {names}; a setting that uses one is "
                         "listed as unresolved")
    out.unresolved = state.unset
    return out


# ------------------------------------------------------------------------------------------ lines

def _logical_lines(text: str, state: _State):
    """Lines with continuations joined, comments removed, multi-line quotes, arrays and heredocs whole."""
    text = re.sub(r"\\[ \t]*\r?\n", "", text)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", strip_comment(raw))
        if heredoc and "<<<" not in raw:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
            yield strip_comment(raw)[:heredoc.start()]
            continue
        if _ARRAY_OPEN.match(raw) and not balanced_parens(strip_comment(raw)):
            parts = [strip_comment(raw)]
            while i < len(lines) and not balanced_parens(" ".join(parts)):
                parts.append(strip_comment(lines[i]))
                i += 1
            yield " ".join(parts)
            continue
        line = strip_comment(raw)
        while open_quote(line) and i < len(lines):
            state.budget.spend(len(line), "a quote that spans many lines")
            line += "\n" + lines[i]
            i += 1
            line = strip_comment(line)
        if raw.lstrip().startswith("#SBATCH"):
            state.sbatch(raw.strip()[len("#SBATCH"):])
        yield line


# ------------------------------------------------------------------------------------------ state

class _State(Variables):
    """The script read so far: its variables (peers.expand), the if blocks and loops it is in, the trainer's launch."""

    def __init__(self, trainer: re.Pattern = TRAINERS):
        self.launch = Launch()
        super().__init__(self.launch.notes)
        self.wanted = trainer
        self.sourced = False  # a `source FILE` seen (its variables unknown here)
        self.frames: list[list] = []  # if blocks: [parent_active, taken, active]
        self.skip = 0  # depth inside loops, functions and case blocks

    @property
    def active(self) -> bool:
        return self.skip == 0 and all(f[2] for f in self.frames)

    def sbatch(self, opts: str) -> None:
        self.layout(shlex.split(opts))

    def line(self, line: str) -> None:
        m = _ARRAY_OPEN.match(line)
        if m and self.active:
            body = line[m.end(2) - len(m.group(2)):].rstrip()
            body = body[:-1] if body.endswith(")") else body
            self.vars[m.group(1)] = [str(w) for w in tokens(self.expand(body))]
            return
        cond = bool(re.match(r"\s*(if|elif|while|until|\[)", line)) or not self.active  # skipped: no names
        words = tokens(self.expand(line, empty_unset=cond))
        if not cond:
            words = [w for w in words if w]  # "$@" with no arguments is no word at all
        for stmt in statements(words):
            self.statement(stmt, line)

    def statement(self, toks: list[str], line: str) -> None:
        while len(toks) > 1 and toks[0] in ("then", "do"):
            toks = toks[1:]  # `then CMD`, `do CMD`: CMD
        head = toks[0]
        if head in ("for", "while", "until", "case", "select") or (head.endswith("()") or toks[-1] == "{"):
            self.skip += 1
            return
        if head in ("done", "esac", "}"):
            self.skip = max(0, self.skip - 1)
            return
        if self.skip:
            return
        if head in ("source", ".") and self.active and len(toks) > 1:
            self.sourced = True
            self.launch.notes.append(f"`{head} {toks[1]}` is not read: the variables it sets are not known here")
            return
        if head == "if":
            parent = self.active
            decided, why = condition(toks[1:])
            self.frames.append([parent, decided, decided])
            if parent and why:
                self.launch.notes.append(why)
            return
        if head in ("elif", "else") and self.frames:
            f = self.frames[-1]
            decided, why = (True, "") if head == "else" or f[1] else condition(toks[1:], "elif")
            f[2] = not f[1] and decided
            f[1] = f[1] or f[2]
            if why and f[0]:
                self.launch.notes.append(why)
            return
        if head == "fi" and self.frames:
            self.frames.pop()
            return
        if head in ("then", "do") or not self.active:
            return
        if re.fullmatch(r"[\w./+-]+", head) and not head.startswith("-"):  # a bare list of flags has none
            self.launch.commands.append(head.rsplit("/", 1)[-1])
        while toks and toks[0] in ("export", "local", "readonly", "declare", "typeset") or toks and \
                toks[0].startswith("-") and toks[0] != "--":
            toks = toks[1:]
        if toks and all(_ASSIGN.match(t) for t in toks) and (head in ("export", "local", "readonly", "declare",
                                                                          "typeset") or _ASSIGN.match(head)):
            for t in toks:
                name, plus, value = _ASSIGN.match(t).groups()
                old = self.vars.get(name, "") if plus else ""
                value = (old if isinstance(old, str) else " ".join(old)) + value
                if len(value) > MAX_CHARS:
                    raise TooMuch(f"${name} would be longer than {MAX_CHARS:,} characters")
                self.vars[name] = value
            return
        self.command(toks)

    # -------------------------------------------------------------------------------------- commands

    def command(self, toks: list[str]) -> None:
        while True:  # the wrappers around the command, one by one (a loop: a script may stack thousands)
            while toks and _ASSIGN.match(toks[0]):
                toks = toks[1:]  # `CUDA_VISIBLE_DEVICES=0,1 python ...`: the environment of that one command
            if not toks:
                return
            name, rest = toks[0].rsplit("/", 1)[-1], toks[1:]
            if name in ("nohup", "time", "exec", "env", "command", "stdbuf", "numactl", "taskset", "uv", "poetry"):
                if name in ("uv", "poetry") and rest[:1] == ["run"]:
                    rest = rest[1:]
                while name == "env" and rest[:1] and rest[0].startswith("-"):  # env's own options, not the command's
                    rest = rest[2:] if rest[0] in ("-u", "--unset", "-C", "--chdir") else rest[1:]
                toks = rest
            elif name == "srun":
                toks = rest[self.layout(rest, until_command=True):]
            elif name == "ray":
                if "--" not in rest:
                    return
                toks = rest[rest.index("--") + 1:]
            else:
                break
        if name in ("bash", "sh") and "-c" in rest:
            inner = rest[rest.index("-c") + 1] if rest.index("-c") + 1 < len(rest) else ""
            self.enter("`bash -c` inside `bash -c`")
            for line in _logical_lines(inner, self):
                self.line(line)
            self.depth -= 1
        elif name == "torchrun" or name == "deepspeed":
            i = self.layout(rest, until_command=True)
            self.trainer(f"{name} {rest[i] if i < len(rest) else ''}".strip(), rest[i + 1:])
        elif name == "accelerate" and rest[:1] == ["launch"]:
            i = self.layout(rest[1:], until_command=True) + 1
            if rest[i:i + 1] == ["-m"]:
                i += 1
            self.trainer(f"accelerate launch {rest[i] if i < len(rest) else ''}".strip(), rest[i + 1:])
        elif name == "trl" and rest[:1] == ["vllm-serve"]:
            self.launch.server = self.launch.server or rest[1:]
        elif name == "trl" and rest:
            self.trainer(f"trl {rest[0]}", rest[1:])
        elif re.fullmatch(r"python[0-9.]*", name):
            i = 0
            while i < len(rest) and rest[i].startswith("-") and rest[i] != "-m":
                i += 1
            if i < len(rest) and rest[i] == "-m" and i + 1 < len(rest):
                self.trainer(f"{toks[0]} -m {rest[i + 1]}", rest[i + 2:])
            elif i < len(rest):
                self.trainer(f"{toks[0]} {rest[i]}", rest[i + 1:])

    def trainer(self, program: str, args: list[str]) -> None:
        if self.found or not self.wanted.search(program.split()[-1] if program.split() else ""):
            self.launch.ran.append(program)  # a helper (data preparation, a server), or another peer's trainer
            return
        self.launch.program, self.launch.args, self.found = program, args, True

    def layout(self, toks: list[str], until_command: bool = False) -> int:
        """Launcher options (srun, #SBATCH, torchrun, accelerate) into the layout; returns where they end."""
        value_opts = {"-N", "--nodes", "--num_machines", "--num-machines", "--nnodes", "--num_processes",
                      "--num-processes", "--nproc_per_node", "--nproc-per-node", "--gres", "--gpus-per-node",
                      "--config_file", "--config-file", "--num_gpus", "--num_nodes", "-n", "-w", "-p", "-A", "-J",
                      "-t", "--ntasks", "--ntasks-per-node", "--container-image", "--container-mounts", "--mem",
                      "--main_process_ip", "--main_process_port", "--machine_rank", "--master_addr",
                      "--master_port", "--node_rank", "--rdzv_endpoint", "--rdzv_backend", "--mixed_precision",
                      "--deepspeed_config_file", "--zero_stage", "--cpus-per-task", "-c", "--gpus"}
        out = self.launch if not self.found else Launch()  # the trainer's layout is the one before it
        i = 0
        while i < len(toks) and toks[i].startswith("-"):
            opt, eq, value = toks[i].partition("=")
            if not eq and opt in value_opts and i + 1 < len(toks):
                value, i = toks[i + 1], i + 1
            i += 1
            num = int(value) if re.fullmatch(r"[0-9]+", value or "") else None
            gpus = re.search(r"gpu(?::[\w-]+)?:([0-9]+)", value or "")
            if opt in ("-N", "--nodes", "--num_machines", "--num-machines", "--nnodes", "--num_nodes") and num:
                out.nnodes = num
                if opt in ("--num_machines", "--num-machines"):
                    out.num_machines = num
            elif opt in ("--num_processes", "--num-processes") and num:
                out.num_processes = num
            elif opt in ("--nproc_per_node", "--nproc-per-node", "--num_gpus") and num:
                out.gpus_per_node = num
            elif opt == "--gres" and gpus:
                out.gpus_per_node = int(gpus.group(1))
            elif opt == "--gpus-per-node" and re.search(r"([0-9]+)$", value or ""):
                out.gpus_per_node = int(re.search(r"([0-9]+)$", value).group(1))
            elif opt in ("--config_file", "--config-file"):
                out.launcher_config = value
        return i if until_command else len(toks)
