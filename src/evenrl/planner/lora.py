"""model.lora in the plan: its findings (`rule_lora`, one of planner.rules.RULES); the adapters' size for the memory
and push estimates is planner.adapters'.

    evenrl plan examples/demo.yaml model.lora.rank=16 model.lora.target_modules=[q_proj,v_proj]

Target modules are checked against the tensor names of the model's safetensors weights (their headers, no torch), so
a name that matches no layer of the decoder blocks fails here, as evenrl.models.lora.add_adapters would refuse it once
the model had loaded; so does model.lora.experts on a model without routed experts (config.json and weight names).
Pure Python: never imports torch.
"""

from __future__ import annotations

from evenrl.errors import UsageError
from evenrl.models.files import weight_names
from evenrl.planner.types import Finding, Plan


def rule_lora(p: Plan) -> list[Finding]:
    c, out = p.config, []
    lora = c.model.lora
    if c.log.save_merged and not lora.rank:
        out.append(Finding("warning", "save-merged-without-lora", "log.save_merged=true merges LoRA adapters into "
                           "final/merged/, but model.lora.rank is 0: final/ is the whole trained model already",
                           "log.save_merged=false, or model.lora.rank=16"))
    if not lora.rank:
        given = sorted(lora.model_fields_set & {"alpha", "dropout", "target_modules", "experts"})
        if given:
            out.append(Finding("warning", "lora-off", f"model.lora.{', model.lora.'.join(given)} set, but "
                               "model.lora.rank is 0: LoRA is off, so these do nothing (every weight trains)",
                               "model.lora.rank=16 to train adapters; or drop them"))
        return out
    if lora.dropout > 0 and c.train.reproducibility != "bitwise":  # bitwise seeds every micro-batch's masks
        out.append(Finding("warning", "lora-dropout",
                           f"model.lora.dropout={lora.dropout:g} draws dropout masks per micro-batch on each rank: "
                           "the update then differs from one layout to another (everything else stays exact)",
                           "model.lora.dropout=0; or train.reproducibility=bitwise (masks keyed per micro-batch)"))
    # adapters go on the decoder blocks' linear layers only (models.lora.add_adapters says why)
    blocks = {m for m in _modules(c.model.path) if ".layers." in m}
    missing = [t for t in lora.target_modules if blocks and not any(m.endswith("." + t) for m in blocks)]
    if lora.experts and not _has_experts(p, c.model.path):
        model = c.model.path or (p.dims.model_type if p.dims else "the model")
        out.append(Finding("error", "lora-experts", f"model.lora.experts: true, but {model} has no routed experts "
                           "(its config.json names none, or its weights no experts' tensors): adapters on the "
                           "experts need a mixture of experts", "model.lora.experts=false"))
    if missing:
        names = sorted({m.rsplit(".", 1)[-1] for m in blocks if "norm" not in m})
        out.append(Finding("error", "lora-targets",
                           f"model.lora.target_modules: {', '.join(missing)} name{'s' if len(missing) == 1 else ''} "
                           f"no layer of the decoder blocks of {c.model.path} (they have {', '.join(names)})",
                           "model.lora.target_modules=[] (every linear layer of the decoder blocks), or names from "
                           "that list"))
    return out


def _has_experts(p: Plan, path: str) -> bool:
    """Whether the model has routed experts to adapt: its config.json counts them and its weights hold them, fused
    (`experts.gate_up_proj`) or one by one (`experts.0.gate_proj.weight`); true when neither can be read (rule_model
    says why)."""
    if p.dims is not None and not p.dims.experts:
        return False
    names = _modules(path)
    return not names or any(".experts." in m or m.endswith(".experts") for m in names)


def _modules(path: str) -> set[str]:
    """The names of the model's modules that hold weights; empty when they cannot be read (rule_model says why)."""
    try:
        return {name.rsplit(".", 1)[0] for name in weight_names(path) if "." in name} if path else set()
    except UsageError:
        return set()
