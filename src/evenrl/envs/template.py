"""The chat template as a multi-turn trajectory uses it: rendering, the check that it extends history as a prefix,
and the text of an environment turn.

A trajectory holds tokens, never re-tokenized text: the prompt (the opening messages rendered with the
generation prompt), then each turn's sampled tokens as the engine returned them, then each environment turn as the
text the template appends, tokenized alone. That is the conversation the template renders only if rendering k + 1
turns extends the rendering of k turns: the assistant's text verbatim, earlier turns unchanged. Templates that
rewrite history (a thinking template that strips earlier <think> blocks, one that reformats the assistant's tool
calls) break it, and a trajectory would then train on a conversation the model is never shown at inference.
`prefix_problem` renders a probe conversation turn by turn and says where it breaks; `evenrl plan` runs it on the
template read from model.path (no torch: transformers' jinja renderer), the trainer before it loads weights, and
`env_turn_text` checks every real turn again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from evenrl.errors import UsageError, describe_error

# render(messages, tool schemas or None, add_generation_prompt) -> text
Render = Callable[[list[dict], "list[dict] | None", bool], str]

_THINK = "<think>\nprobe reasoning\n</think>\n\n"


class TemplateDrift(Exception):
    """A turn's rendering does not extend the conversation so far (the message says where)."""


def tokenizer_render(tokenizer) -> Render:
    """The tokenizer's own chat template (what the trainer renders with)."""
    def render(messages, tools, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return render


def file_render(model_path: str) -> Render | None:
    """The chat template saved in a model directory, rendered as transformers renders it, without loading the
    tokenizer (which imports torch): chat_template.jinja, else tokenizer_config.json's chat_template. None when the
    directory has none."""
    from transformers.utils.chat_template_utils import render_jinja_template

    d = Path(model_path).expanduser()
    config = _json(d / "tokenizer_config.json")
    template = None
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        template = named.get("default")
    if not template:
        return None
    special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in config.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}

    def render(messages, tools, add_generation_prompt):
        return render_jinja_template([messages], tools=tools, chat_template=template,
                                     add_generation_prompt=add_generation_prompt, **special)[0][0]
    return render


def _json(f: Path) -> dict:
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def prefix_problem(render: Render, tools: list[dict] | None, roles: tuple[str, ...]) -> str | None:
    """Why the template cannot carry a trajectory whose environment answers with messages of `roles`, or None.
    Renders a probe conversation (a user question; assistant turns with a <think> block; environment messages)
    one turn at a time and checks each rendering starts with the one before plus the assistant's text verbatim."""
    for role in roles:
        messages = [{"role": "user", "content": "probe question"}]
        try:
            text = render(messages, tools, True)
            for k in range(2):
                reply = f"{_THINK}probe answer {k}"
                messages = messages + [{"role": "assistant", "content": reply},
                                       {"role": role, "content": f"probe {role} message {k}"}]
                new = render(messages, tools, True)
                if not new.startswith(text + reply):
                    where = _divergence(text + reply, new)
                    return (f"the chat template rewrites history: after a {role!r} message, turn {k + 2}'s rendering "
                            f"does not start with turn {k + 1}'s plus the assistant's text ({where}); e.g. a thinking "
                            "template that strips earlier <think> blocks, or one that reformats earlier assistant "
                            "messages")
                text = new
        except Exception as e:  # a template can raise anything (raise_exception, a missing key)
            return f"the chat template cannot render a conversation with {role!r} messages ({describe_error(e)})"
    return None


def _divergence(old: str, new: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    return f"at character {at}: {old[at:at + 30]!r} became {new[at:at + 30]!r}"


PREFIX_FIX = ("a chat template that renders earlier turns unchanged (e.g. Qwen3's with the reasoning of earlier turns "
              "kept), saved into model.path/chat_template.jinja")


def check_template(render: Render | None, tools: list[dict] | None, roles: tuple[str, ...], where: str) -> None:
    """UsageError (one line) when a trajectory cannot be built with this template; `where` names the model."""
    if render is None:
        raise UsageError(f"rollout.env: {where} has no chat template; multi-turn rollouts render the conversation "
                         "with it (save one with the tokenizer, or into chat_template.jinja)")
    problem = prefix_problem(render, tools, roles)
    if problem:
        raise UsageError(f"rollout.env: {where}: {problem}; use {PREFIX_FIX}")


def env_turn_text(render: Render, messages: list[dict], tools: list[dict] | None, history: str, reply: str,
                  eos_text: str | None) -> tuple[str, str]:
    """(the text an environment turn appends after the sampled reply, the new history text). `messages` is the
    conversation with the reply and the environment's messages; `history` the rendering before the reply (with
    the generation prompt); `eos_text` the EOS token's text when the reply ended with EOS (a template that renders
    it itself then appends what follows it). Raises TemplateDrift when the rendering does not extend the history."""
    new = render(messages, tools, True)
    if not new.startswith(history + reply):
        raise TemplateDrift(f"the chat template rewrote the conversation ({_divergence(history + reply, new)})")
    rest = new[len(history) + len(reply):]
    if eos_text and rest.startswith(eos_text):
        rest = rest[len(eos_text):]
    return rest, new
