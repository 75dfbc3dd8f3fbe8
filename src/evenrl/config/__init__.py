"""The run configuration: typed, described, loaded from one YAML file plus dotted overrides.

    evenrl plan examples/demo.yaml data.prompts_per_step=512 rollout.samples_per_prompt=8

`schema` holds the typed sections and RunConfig, `yaml_reader` the bounded YAML reader, `overrides` the dotted
overrides, `load` load_config and its one-line errors, `reference` the generated docs/config.md. Pure Python:
never imports torch (the planner uses it).
"""

from evenrl.config.load import config_to_yaml, load_config, validation_message
from evenrl.config.overrides import apply_overrides, flatten, set_dotted, with_settings
from evenrl.config.reference import describe
from evenrl.config.schema import RunConfig
from evenrl.config.section import MAX_COUNT, MAX_SEED, MAX_TOKENS
from evenrl.config.yaml_reader import (MAX_YAML_BYTES, MAX_YAML_CHARS, MAX_YAML_DEPTH, MAX_YAML_NODES, parse_yaml,
                                       read_text_file, read_yaml, yaml_error_line)
