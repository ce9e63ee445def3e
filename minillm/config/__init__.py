"""Typed configuration: one YAML file, four sections (model, data, train, sample).

`from minillm.config import load_config, ModelConfig` is the stable entry (docs/design.md,
"Python API"). Modules: `schema` (the typed sections and their checks; the model's MoE keys
in `moe`, its MLA keys in `mla`, `model.rope_scaling` in `rope_scaling`, the train section in
`train_schema`, what they share in `section`), `loading` (YAML, `--set` overrides, type
conversion, suggestions). A leaf of the layers: it imports only minillm.errors.
"""

from minillm.config.loading import (
    _type_name,
    apply_override,
    config_from_dict,
    config_to_dict,
    did_you_mean,
    dump_config,
    load_config,
    override_keys,
    read_raw_config,
)
from minillm.config.rope_scaling import ROPE_SCALING_TYPES, RopeScalingConfig
from minillm.config.schema import (
    POSITION_KEYS,
    SECTIONS,
    Config,
    DataConfig,
    ModelConfig,
    SampleConfig,
)
from minillm.config.section import DEVICE_PATTERN
from minillm.config.train_schema import LORA_TARGETS, LoRAConfig, TrainConfig
from minillm.errors import ConfigError

__all__ = [
    "DEVICE_PATTERN",
    "LORA_TARGETS",
    "SECTIONS",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoRAConfig",
    "ModelConfig",
    "POSITION_KEYS",
    "ROPE_SCALING_TYPES",
    "RopeScalingConfig",
    "SampleConfig",
    "TrainConfig",
    "_type_name",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "did_you_mean",
    "dump_config",
    "load_config",
    "override_keys",
    "read_raw_config",
]
