"""Reward functions, the registry and score_all, including hostile completions and misbehaving user rewards.

The misbehaving rewards are module-level so worker processes can import them by reference (as `test_rewards.x`).
"""

import builtins
import itertools
import math
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import evenrl.rewards.math as math_module
from evenrl.errors import UsageError
from evenrl.rewards import REGISTRY, resolve, score_all
from evenrl.rewards.arithmetic import exact_match_reward, make_addition_problem
from evenrl.rewards.countdown import FORMAT_SCORE, countdown_reward, make_countdown_problem
from evenrl.rewards.format import format_reward, last_tag, strict_format_reward
from evenrl.rewards.knights_knaves import kk_reward, make_kk_problem
from evenrl.rewards.math import extract_answer, last_boxed, math_reward

HOSTILE = ["", " ", "9" * 10000, "😀é∑\u202e\x00", "\\boxed{" * 5000, "}" * 5000, "<answer>" * 5000,
           "<think>" * 5000, "<answer>__import__('os').system('echo pwned')</answer>", "\\boxed{\\frac{1}{2}"]


def fast(fn, *args, limit=1.0):
    start = time.perf_counter()
    result = fn(*args)
    assert time.perf_counter() - start < limit, f"{fn.__name__} took too long"
    return result


# ----------------------------------------------------------------------------------------------- math


def test_last_boxed_nested_unbalanced_and_escaped():
    assert last_boxed(r"so \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert last_boxed(r"\boxed{3} and a broken \boxed{\frac{1}{2}") == "3"  # the last one never closes
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed("no box") is None
    assert fast(last_boxed, "\\boxed{" * 20000) is None
    assert fast(last_boxed, "\\boxed{1}" + "}" * 20000) == "1"


def test_extract_answer_priority():
    assert extract_answer(r"<answer>5</answer> \boxed{6}") == "6"
    assert extract_answer("<answer> x+1 </answer> 12") == "x+1"
    assert extract_answer("it is 3, no, 1,000.5 apples") == "1,000.5"
    assert extract_answer("<answer> </answer> 4") == "4"
    assert extract_answer("nothing here") is None


@pytest.mark.parametrize("completion, gold, score", [
    (r"The answer is \boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
    ("<answer>1,000</answer>", "1000", 1.0),
    ("so we get 42", 42, 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1, 2\}", 1.0),
    (r"\boxed{7}", r"The solution ... \boxed{7}", 1.0),
    (r"\boxed{8}", "7", 0.0),
    (r"\boxed{x+1}", "x+2", 0.0),
    ("no answer at all", "7", 0.0),
])
def test_math_reward(completion, gold, score):
    assert math_reward(completion, {"answer": gold}) == score


@pytest.mark.parametrize("completion", HOSTILE)
def test_math_reward_hostile(completion):
    assert fast(math_reward, completion, {"answer": "7"}, limit=3.0) == 0.0


def test_math_reward_huge_number_still_exact():
    huge = "9" * 10000
    assert fast(math_reward, f"\\boxed{{{huge}}}", {"answer": huge}, limit=3.0) == 1.0


def test_math_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(math_module, "_math_verify", lambda: None)
    assert math_reward(r"\boxed{\dfrac{1}{2}}", {"answer": r"\frac{1}{2}"}) == 1.0
    assert math_reward("<answer>1,000</answer>", {"answer": "1000.0"}) == 1.0
    assert math_reward(r"\boxed{0.5}", {"answer": r"\frac{1}{2}"}) == 0.0  # only math-verify knows this one


def test_math_fallback_when_math_verify_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_module, "_math_verify", lambda: (broken, broken))
    math_module._parse_gold.cache_clear()
    assert math_reward(r"\boxed{12}", {"answer": "12"}) == 1.0
    assert math_reward(r"\boxed{13}", {"answer": "12"}) == 0.0
    math_module._parse_gold.cache_clear()


def test_math_reward_off_the_main_thread():
    # math-verify's own signal-based limit raises off the main thread unless switched off; we switch it off.
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(math_reward, [r"\boxed{\frac{2}{4}}", r"\boxed{3}"], [{"answer": "0.5"}] * 2))
    assert scores == [1.0, 0.0]


# ----------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize("completion, lenient, strict", [
    ("<think>hmm</think>\n<answer>4</answer>", 1.0, 1.0),
    ("  <think>a</think><answer>b</answer>\n", 1.0, 1.0),
    ("intro <think>a</think> <answer>b</answer> outro", 1.0, 0.0),
    ("<think>a</think> x <answer>b</answer>", 0.0, 0.0),
    ("<think>a</think><think>b</think><answer>c</answer>", 1.0, 0.0),
    ("<think> </think><answer>c</answer>", 1.0, 0.0),
    ("<answer>b</answer><think>a</think>", 0.0, 0.0),
    ("<think>a</think><answer>b", 0.0, 0.0),
    ("<think>a<answer>b</answer>", 0.0, 0.0),
])
def test_format_reward(completion, lenient, strict):
    assert format_reward(completion, {}) == lenient
    assert format_reward(completion, {}, strict=True) == strict == strict_format_reward(completion, {})


def test_format_reward_prefilled_think_and_hostile():
    sample = {"prompt": "User: solve it.\nAssistant: <think>"}
    assert format_reward("step 1</think> <answer>5</answer>", sample) == 1.0
    assert strict_format_reward("step 1</think> <answer>5</answer>", sample) == 1.0
    assert format_reward("step 1</think> <answer>5</answer>", {}) == 0.0
    for completion in HOSTILE + ["<think>" * 20000 + "</think>" + "<answer>" * 20000]:
        assert fast(format_reward, completion, {}, limit=0.2) == 0.0
        assert fast(strict_format_reward, completion, {}, limit=0.2) == 0.0


def test_last_tag():
    assert last_tag("<answer>1</answer> <answer>2</answer>", "answer") == "2"
    assert last_tag("<answer>1</answer> <answer>2", "answer") == "1"
    assert last_tag("<answer><answer>x</answer>", "answer") == "x"
    assert last_tag("</answer><answer>", "answer") is None


# ----------------------------------------------------------------------------------------------- countdown


def test_countdown_generator_is_solvable():
    rng = random.Random(0)
    for _ in range(200):
        p = make_countdown_problem(rng)
        assert len(p["numbers"]) in (3, 4) and all(1 <= x <= 99 for x in p["numbers"])
        assert 1 <= p["target"] <= 999 and str(p["numbers"]) in p["prompt"] and str(p["target"]) in p["prompt"]
        assert countdown_reward(f"<think>easy</think> <answer>{p['solution']}</answer>", p) == 1.0
    assert make_countdown_problem(random.Random(5)) == make_countdown_problem(random.Random(5))


SAMPLE = {"numbers": [3, 5, 7], "target": 22}


@pytest.mark.parametrize("answer, score", [
    ("3 * 5 + 7", 1.0),
    ("7 + (5 * 3)", 1.0),
    ("(7 - 5 / 5) ...", 0.0),  # not an expression
    ("3 * 5 + 7 = 22", 0.0),  # an equation, not an expression (TinyZero's eval rejects it too)
    ("3 * 5 - 7", FORMAT_SCORE),  # wrong value
    ("3 * 5 + 7 + 0", FORMAT_SCORE),  # extra number
    ("3 * 7 + 1", FORMAT_SCORE),  # wrong numbers
    ("22", FORMAT_SCORE),
    ("3 / (5 - 5) + 7", FORMAT_SCORE),  # division by zero (and 5 twice)
    ("-(3 - 5) * 7 + 3 * 5 - 7 - 5 + 3", FORMAT_SCORE),
    ("3.0 * 5 + 7", 0.0),  # only integer literals
    ("3 × 5 + 7", 0.0),
    ("3 ** 5 + 7", 0.0),
    ("2 ** 10 ** 10 ** 10", 0.0),  # would hang an eval-based checker
    ("__import__('os').system('echo pwned')", 0.0),
    ("(lambda: 22)()", 0.0),
    ("[3, 5, 7]", 0.0),
    ("True + 21", 0.0),
    ("(" * 150 + "3" + ")" * 150, 0.0),
    ("9" * 10000, 0.0),
])
def test_countdown_reward(answer, score):
    assert fast(countdown_reward, f"<think>...</think><answer>{answer}</answer>", SAMPLE, limit=0.5) == score


def test_countdown_uses_last_answer_and_never_evals(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("reward code must not eval/exec model output")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert countdown_reward("<answer>1+1</answer> <answer>3*5+7</answer>", SAMPLE) == 1.0
    assert countdown_reward("<answer>3*5+7</answer> <answer>1+1</answer>", SAMPLE) == FORMAT_SCORE
    assert countdown_reward("3*5+7", SAMPLE) == 0.0
    for completion in HOSTILE:
        assert fast(countdown_reward, completion, SAMPLE, limit=0.5) == 0.0


# ----------------------------------------------------------------------------------------------- knights and knaves


def independent_truth(s, knights):
    kind = s[0]
    if kind in ("knight", "knave"):
        return knights[s[1]] == (kind == "knight")
    a, b = independent_truth(s[1], knights), independent_truth(s[2], knights)
    return {"and": a and b, "or": a or b, "iff": a == b, "implies": b or not a}[kind]


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_kk_generator_unique_solution(n):
    rng = random.Random(n)
    for _ in range(10):
        p = make_kk_problem(rng, n)
        names = p["names"]
        assert len(set(names)) == n and all(name in p["prompt"] for name in names)
        solutions = [
            dict(zip(names, knights))
            for knights in itertools.product([True, False], repeat=n)
            if all(independent_truth(s, knights) == knights[who] for who, s in p["statements"])
        ]
        assert solutions == [p["solution"]]
        roles = [f"{name} is a {'knight' if knight else 'knave'}" for name, knight in p["solution"].items()]
        answer = "\n".join(f"({i + 1}) {role}" for i, role in enumerate(roles))
        assert kk_reward(f"<think>...</think><answer>\n{answer}\n</answer>", p) == 1.0


KK = {"solution": {"Zoey": True, "Oliver": False, "Leo": True}}


@pytest.mark.parametrize("answer, score", [
    ("Zoey is a knight, Oliver is a knave, Leo is a knight", 1.0),
    ("(1) ZOEY is a Knight\n(2) oliver is a knave\n(3) Leo is a knight.", 1.0),
    ("Zoey is a knight, Oliver is a knight, Leo is a knight", 0.0),
    ("Zoey is a knight, Leo is a knight", 0.0),  # Oliver missing
    ("Zoey is a knight, Oliver is a knave, Oliver is a knight, Leo is a knight", 0.0),  # hedging
    ("Zoey is a knight, Oliver is not a knight, Leo is a knight", 0.0),
    ("Zoey is a knight, Oliver is a knave, Leon is a knight", 0.0),
    ("", 0.0),
])
def test_kk_reward(answer, score):
    assert kk_reward(f"<think>Zoey is a knave?</think><answer>{answer}</answer>", KK) == score


def test_kk_reward_needs_answer_tag_and_survives_hostile():
    assert kk_reward("Zoey is a knight, Oliver is a knave, Leo is a knight", KK) == 0.0
    for completion in HOSTILE + ["<answer>" + "Zoey is a " * 5000 + "</answer>"]:
        assert fast(kk_reward, completion, KK, limit=0.5) == 0.0


# ----------------------------------------------------------------------------------------------- arithmetic


def test_addition_and_exact_match():
    rng = random.Random(0)
    problems = [make_addition_problem(rng, 9) for _ in range(100)]
    for p in problems:
        a, b = map(int, p["prompt"].rstrip("=").split("+"))
        assert 0 <= a <= 9 and 0 <= b <= 9 and p["answer"] == str(a + b)
    assert exact_match_reward(" 8\n", {"answer": "8"}) == 1.0
    assert exact_match_reward("8", {"answer": 8}) == 1.0
    assert exact_match_reward("8.0", {"answer": "8"}) == 0.0
    assert exact_match_reward("", {"answer": "8"}) == 0.0


# ----------------------------------------------------------------------------------------------- registry


def test_registry_and_resolve():
    assert set(REGISTRY) >= {"math", "format", "countdown", "knights_knaves", "exact_match"}
    for name, fn in REGISTRY.items():
        assert resolve(name) is fn
    assert resolve("evenrl.rewards.math:math_reward") is math_reward
    assert resolve("os.path:join") is os.path.join


@pytest.mark.parametrize("spec, detail", [
    ("maths", "a built-in reward"),
    ("mypkg.rewards", "package.module:function"),
    ("no_such_module_xyz:score", "importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("os:no_such_function", "os has no function no_such_function"),
    ("os:sep", "os has no function sep"),
])
def test_resolve_errors_are_one_line(spec, detail):
    with pytest.raises(UsageError) as info:
        resolve(spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"reward: got '{spec}'") and detail in message


# ----------------------------------------------------------------------------------------------- score_all


def one(completion, sample):
    return 1.0


def length(completion, sample):
    return len(completion)


def raises(completion, sample):
    raise ValueError("bad reward " + "x" * 1000)


def exits(completion, sample):
    sys.exit(3)


def returns_junk(completion, sample):
    return {"none": None, "str": "abc", "nan": math.nan, "inf": -math.inf, "huge": 10**400,
            "bool": True, "int": 2}[completion]


def sleeps(completion, sample):
    if completion == "slow":
        time.sleep(60)
    return 1.0


def spins(completion, sample):
    while completion == "slow":
        pass
    return 1.0


def stuck_in_c(completion, sample):
    if completion == "slow":
        sum(range(10**13))  # C loop: SIGALRM cannot interrupt it, only killing the worker can
    return 1.0


def swallows(completion, sample):
    while completion == "slow":
        try:
            time.sleep(60)
        except BaseException:
            pass
    return 1.0


def crashes(completion, sample):
    if completion == "slow":
        os._exit(7)
    return 1.0


def hogs_memory(completion, sample):
    if completion == "slow":
        return len(bytearray(512 * 2**20))  # past a 256 MiB cap
    if completion == "leaky":
        return len([bytearray(2**20) for _ in range(512)])  # 512 MiB, 1 MiB at a time
    return 1.0


def uses_numpy(completion, sample):
    import numpy  # a library that maps far more address space than it uses loads under the default cap

    return float(numpy.ones(1000).sum())


def sums(completion, sample):
    return float(sum(i for i in range(2000)))  # ~0.1 ms of CPU


def burns_cpu(completion, sample):
    x = 0
    while completion == "slow":
        x += 1
    return 1.0


def works(completion, sample):
    """int(completion) steps of a fixed loop: the same CPU time on an idle or a loaded machine."""
    x = 0
    for i in range(int(completion)):
        x += i & 7
    return 1.0


def ignores_cpu_limit(completion, sample):
    deadline = time.monotonic() + 3.0
    while completion == "slow" and time.monotonic() < deadline:
        try:
            while time.monotonic() < deadline:
                pass
        except BaseException:
            pass
    return 1.0


def connects(completion, sample):
    import socket

    with socket.create_connection(("127.0.0.1", int(completion)), timeout=2):
        return 1.0


def test_reward_workers_have_no_network():
    """A reward (or environment step) that connects to a server listening on this machine's loopback fails in a
    worker (own network namespace, or a refused socket), while the same call in the trainer process connects."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        assert connects(port, {}) == 1.0  # the server is reachable from here
        scores, stats = score_all([(connects, 1.0)], [port], [{}], timeout_s=5)
    assert scores == [0.0] and stats["raised"] == 1
    assert any(w in stats["by_reward"]["connects"]["first_error"] for w in ("unreachable", "network", "refused")), stats


def test_a_worker_whose_trainer_died_ends_quietly():
    """The trainer killed (a SIGSEGV, the launcher's SIGKILL) while its reward worker scores: the worker's answer
    finds the pipe closed, and it ends with exit 0 and nothing on stderr (it printed a BrokenPipeError traceback
    under the launcher's line for the dead rank)."""
    import pickle
    import subprocess
    from multiprocessing import Pipe

    from evenrl.isolation.pool import _WORKER_CODE, Limits

    parent, child = Pipe()
    worker = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(child.fileno()), "plain"],
                              pass_fds=(child.fileno(),), stderr=subprocess.PIPE, text=True)
    child.close()
    parent.send(([pickle.dumps(time.sleep)], [(0, 0, (0.5,))], Limits(timeout_s=5, cpu_s=5, memory_mib=0)))
    assert parent.recv() == "loaded"
    parent.close()  # the trainer is gone while the call runs
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0 and err == "", err


def test_weighted_sum_and_stats():
    completions = ["a", "bbb", ""]
    samples = [{}] * 3
    scores, stats = score_all([(one, 0.5), (length, 2.0), (REGISTRY["exact_match"], 1.0)], completions,
                              [{"answer": "a"}, {"answer": "x"}, {"answer": ""}], timeout_s=5)
    assert scores == [0.5 + 2 + 1, 0.5 + 6, 0.5 + 1]
    assert stats["by_reward"]["length"]["mean"] == pytest.approx(4 / 3)
    assert stats["by_reward"]["exact_match"]["mean"] == pytest.approx(2 / 3)
    assert (stats["raised"], stats["bad_value"], stats["timeout"]) == (0, 0, 0) and stats["isolated"]
    assert score_all([], completions, samples, 1)[0] == [0.0] * 3


@pytest.mark.parametrize("isolate", [True, False])
def test_bad_rewards_score_zero_and_are_counted(isolate):
    keys = ["none", "str", "nan", "inf", "huge", "bool", "int"]
    scores, stats = score_all([(returns_junk, 1.0), (raises, 1.0), (exits, 1.0), (one, 1.0)], keys, [{}] * 7,
                              timeout_s=5, isolate=isolate)
    assert scores == [1, 1, 1, 1, 1, 2, 3]
    junk = stats["by_reward"]["returns_junk"]
    assert junk["bad_value"] == 5 and junk["first_error"] == "returned None"
    assert stats["by_reward"]["raises"]["raised"] == 7 and stats["by_reward"]["exits"]["raised"] == 7
    assert stats["by_reward"]["raises"]["first_error"].startswith("ValueError: bad reward xxx")
    assert len(stats["by_reward"]["raises"]["first_error"]) <= 200
    assert (stats["raised"], stats["bad_value"], stats["timeout"], stats["failures"]) == (14, 5, 0, 19)


@pytest.mark.parametrize("fn, isolate", [(sleeps, True), (spins, True), (sleeps, False), (spins, False)])
def test_python_level_hang_times_out(fn, isolate):
    score_all([(one, 1.0)], ["warm"], [{}], 5)  # start the pool outside the timed part
    start = time.perf_counter()
    scores, stats = score_all([(fn, 1.0)], ["ok", "slow", "ok"], [{}] * 3, timeout_s=0.3, isolate=isolate)
    assert time.perf_counter() - start < 2.0
    assert scores == [1.0, 0.0, 1.0] and stats["timeout"] == 1
    assert stats["by_reward"][fn.__name__]["timeout"] == 1


@pytest.mark.parametrize("fn, kind", [(stuck_in_c, "timeout"), (swallows, "timeout"), (crashes, "raised")])
def test_worker_is_killed_and_replaced(fn, kind):
    score_all([(one, 1.0)], ["warm"], [{}], 5)
    start = time.perf_counter()
    completions = ["ok", "slow", "ok", "ok", "ok", "ok"]
    scores, stats = score_all([(fn, 1.0)], completions, [{}] * 6, timeout_s=0.3)
    # 0.3 s limit + 0.5 s grace, then a fresh worker (~0.5 s to import this test module) takes the remaining jobs.
    assert time.perf_counter() - start < 6.0
    assert scores == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0] and stats[kind] == 1
    assert score_all([(one, 1.0)], ["ok"] * 4, [{}] * 4, 5)[0] == [1.0] * 4  # the pool still works


def test_code_stuck_in_c_is_ended_by_its_cpu_limit_not_the_wall_clock():
    """sum(range(10**13)) runs no Python signal handler, so ITIMER_PROF cannot stop it; the per-call RLIMIT_CPU
    (limit + 1 s, whole seconds) ends the worker, and the call fails as "cpu" long before the 60 s backstop."""
    score_all([(one, 1.0)], ["warm"], [{}], 5)
    scores, stats = score_all([(stuck_in_c, 1.0)], ["ok", "slow", "ok"], [{}] * 3, timeout_s=60, cpu_time_limit_s=0.5)
    assert scores == [1.0, 0.0, 1.0] and stats["cpu"] == 1 and stats["timeout"] == 0
    assert "stuck in C" in stats["by_reward"]["stuck_in_c"]["first_error"]


def test_memory_cap_fails_the_call_and_keeps_the_worker():
    score_all([(one, 1.0)], ["warm"], [{}], 5)
    completions = ["ok", "slow", "ok", "leaky", "ok"]
    scores, stats = score_all([(hogs_memory, 1.0)], completions, [{}] * 5, timeout_s=10, memory_limit_mib=256)
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0] and stats["memory"] == 2 and stats["failures"] == 2
    assert stats["failed"] == [False, True, False, True, False]
    assert stats["by_reward"]["hogs_memory"]["first_error"].startswith("ran out of memory (MemoryError")
    # the same calls without a cap succeed: the cap, not the machine, failed them
    scores, stats = score_all([(hogs_memory, 1.0)], ["slow"], [{}], timeout_s=10, memory_limit_mib=0)
    assert scores == [512 * 2**20] and stats["failures"] == 0
    assert score_all([(uses_numpy, 1.0)], ["a"], [{}], timeout_s=30, memory_limit_mib=2048)[0] == [1000.0]


def test_cpu_cap_fails_the_call_before_the_wall_clock_limit():
    score_all([(one, 1.0)], ["warm"], [{}], 5)
    start = time.perf_counter()
    scores, stats = score_all([(burns_cpu, 1.0)], ["ok", "slow", "ok"], [{}] * 3, timeout_s=20, cpu_time_limit_s=0.5)
    assert time.perf_counter() - start < 5.0
    assert scores == [1.0, 0.0, 1.0] and stats["cpu"] == 1 and stats["timeout"] == 0
    assert stats["by_reward"]["burns_cpu"]["first_error"] == "used more than 0.5 s of CPU time"
    # the limit is per call: many calls that each use a little CPU add up to far more than it without failing
    scores, stats = score_all([(sums, 1.0)], ["x"] * 4000, [{}] * 4000, timeout_s=5, cpu_time_limit_s=0.01)
    assert stats["failures"] == 0 and scores == [float(sum(range(2000)))] * 4000


def test_cpu_time_decides_the_same_on_a_loaded_machine_and_the_wall_clock_backstop_is_counted(capfd):
    """Calls that do a fixed amount of work: at the defaults (CPU time decides, the wall clock is a 60 s backstop)
    their worker sharing one CPU with 5 spinning processes gives the results it gives alone, a call past the CPU
    limit failing alike; the feedback environment's first steps in fresh workers (importing math-verify and sympy)
    too. With the wall clock deciding, as before (timeout_s = cpu_time_limit_s = 0.5 s, 2.5x what the calls
    take alone), the loaded machine fails calls, each counted (pool.backstop_hits, the step's
    limits/wall_clock_backstop) and warned. (Not asserted: that those calls pass alone; on this shared machine that
    too depends on the load.)"""
    from e2e import loaded_cpu
    from evenrl.config import RunConfig
    from evenrl.envs.session import EnvSession
    from evenrl.isolation import pool

    rewards = RunConfig().rewards
    assert (rewards.timeout_s, rewards.cpu_time_limit_s) == (60.0, 5.0)
    work = ["4000000"] * 3 + ["100000000"]  # ~0.2 s of CPU each here (6 times that in wall time loaded); ~5 s
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "3+4=", "answer": "7"}]
    steps = [(None, rows[i % 2], i, reply) for i, reply in enumerate(["3", "it is 7", "no", "\\boxed{7}"])]

    def run():
        pool._pool().close()  # fresh workers: the environment's first steps import math-verify and sympy
        scores, stats = score_all([(works, 1.0)], work, [{}] * 4, rewards.timeout_s, cpu_time_limit_s=0.6)
        return scores, stats["cpu"], stats["timeout"], EnvSession("feedback", rewards).steps(steps)

    def wall_clock_decides():
        return score_all([(works, 1.0)], work[:3], [{}] * 3, timeout_s=0.5, cpu_time_limit_s=0.5)[1]["timeout"]

    pool.backstop_hits()
    alone = run()
    assert alone[:3] == ([1.0, 1.0, 1.0, 0.0], 1, 0) and [k for k, _ in alone[3]] == ["ok"] * 4
    assert pool.backstop_hits() == 0
    with loaded_cpu(busy=5):
        assert run() == alone
        assert pool.backstop_hits() == 0
        timeouts = wall_clock_decides()
    assert timeouts >= 1 and pool.backstop_hits() == timeouts
    assert "ran past their wall-clock backstop (0.5 s)" in capfd.readouterr().out
    pool._pool().close()


def test_a_reward_that_swallows_the_cpu_signal_is_stopped_anyway():
    """The limit fires again every 50 ms until one lands outside the reward's `except BaseException` (else the
    wall clock, else the parent's kill, ends it)."""
    score_all([(one, 1.0)], ["warm"], [{}], 5)
    start = time.perf_counter()
    scores, stats = score_all([(ignores_cpu_limit, 1.0)], ["slow", "ok"], [{}] * 2, timeout_s=1.0,
                              cpu_time_limit_s=0.2)
    assert scores == [0.0, 1.0] and stats["cpu"] + stats["timeout"] == 1 and time.perf_counter() - start < 2.5


def test_failed_flags_per_completion_over_several_rewards():
    _, stats = score_all([(one, 1.0), (raises, 0.0)], ["a", "b"], [{}, {}], 5)
    assert stats["failed"] == [True, True]
    _, stats = score_all([(one, 1.0), (crashes, 1.0)], ["a", "slow", "b"], [{}] * 3, 5)
    assert stats["failed"] == [False, True, False] and stats["raised"] == 1


def test_math_reward_hang_is_bounded_inline():
    # Symbolic comparison with 9^(9^9) runs for minutes; inside score_all math-verify's own alarm is switched off
    # (it would cancel ours) and score_all's limit stops it.
    start = time.perf_counter()
    scores, stats = score_all([(math_reward, 1.0)], [r"\boxed{9^{9^{9}}}", r"\boxed{2}"], [{"answer": "2"}] * 2,
                              timeout_s=1.0, isolate=False)
    assert time.perf_counter() - start < 3.0
    assert scores == [0.0, 1.0] and stats["timeout"] == 1


def test_inline_mode_restores_an_outer_timer_and_handler():
    def outer_handler(signum, frame):
        raise AssertionError("the outer timer must not fire during this test")

    previous = signal.signal(signal.SIGALRM, outer_handler)
    saved = signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        scores, _ = score_all([(sleeps, 1.0)], ["ok", "slow"], [{}, {}], timeout_s=0.2, isolate=False)
        assert scores == [1.0, 0.0]
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        assert 29.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *saved)  # give pytest-timeout its own timer back
        signal.signal(signal.SIGALRM, previous)


def test_unpicklable_reward_runs_inline_on_main_thread_only():
    scores, stats = score_all([(lambda c, s: 2.0, 1.0)], ["a"], [{}], 1)
    assert scores == [2.0] and not stats["isolated"]
    result = {}

    def off_main():
        try:
            score_all([(lambda c, s: 2.0, 1.0)], ["a"], [{}], 1)
        except UsageError as e:
            result["error"] = str(e)
        result["pooled"] = score_all([(one, 1.0)], ["a"], [{}], 1, isolate=False)[1]["isolated"]

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert "define rewards at module level" in result["error"] and result["pooled"] is True


def test_score_all_argument_errors():
    with pytest.raises(ValueError):
        score_all([(one, 1.0)], ["a", "b"], [{}], 1)
    with pytest.raises(UsageError, match="timeout_s"):
        score_all([(one, 1.0)], ["a"], [{}], 0)
    with pytest.raises(UsageError, match="cpu_time_limit_s"):
        score_all([(one, 1.0)], ["a"], [{}], 1, cpu_time_limit_s=0)
    with pytest.raises(UsageError, match="memory_limit_mib"):
        score_all([(one, 1.0)], ["a"], [{}], 1, memory_limit_mib=-1)


def test_overhead_for_128_cheap_completions():
    rng = random.Random(0)
    samples = [make_addition_problem(rng) for _ in range(128)]
    completions = [s["answer"] for s in samples]
    fns = [(REGISTRY["exact_match"], 1.0)]
    score_all(fns, completions, samples, 5)  # warm the pool
    for isolate, budget in ((False, 0.02), (True, 0.05)):
        best = min(_timed(lambda: score_all(fns, completions, samples, 5, isolate=isolate)) for _ in range(3))
        assert best < budget, (isolate, best)  # measured ~0.3 ms inline, ~5 ms pooled on 2 shared cores


def _timed(fn):
    start = time.perf_counter()
    scores, _ = fn()
    assert scores == [1.0] * 128
    return time.perf_counter() - start
