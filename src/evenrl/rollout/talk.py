"""A carried multi-turn trajectory's talk (rollout.partial with rollout.env): its turn loop's state kept as data on
the sample (evenrl.rollout.carry's Carried.talk: messages, rendered history, the environment's pickle, the reply it
was cut in, turns, rewards, the loss mask), so it travels from a reserved rollout rank and lies in a checkpoint like
the tokens. The step that spends a trajectory's budget across its turns is evenrl.rollout.trajectories.Turns.advance;
an agent's talk is its transcript (evenrl.agents.replay), encoded the same way.
"""

from __future__ import annotations

import base64
import json

from evenrl.engines.base import Trajectory


def encode(talk: dict | None) -> bytes:
    """A talk as UTF-8 JSON (the environment's pickled state in base64): what pack stores as uint8."""
    if talk is None:
        return b""
    if talk.get("state") is None:  # no pickle (an agent's transcript has none): JSON as it is
        return json.dumps(talk).encode()
    return json.dumps({**talk, "state": base64.b64encode(talk["state"]).decode()}).encode()


def decode(raw: bytes) -> dict | None:
    if not raw:
        return None
    talk = json.loads(raw.decode())
    if talk.get("state") is not None:
        talk["state"] = base64.b64decode(talk["state"])
    return talk


def trajectory(r) -> Trajectory:
    """A carried sample (evenrl.rollout.carry.Carried with talk) as the Trajectory the uncut loop makes."""
    t = r.talk
    return Trajectory(r.position, r.sample, r.tokens.tolist(), r.logprobs.tolist(), r.ended,
                      loss_mask=[c == "1" for c in t["mask"]], reward=t["reward"], failed=t["failed"],
                      error=t["error"], turns=t["turns"], tool_calls=t["tool_calls"], tool_errors=t["tool_errors"],
                      cut_calls=t.get("cut_calls", 0))  # absent from checkpoints written before it was counted
