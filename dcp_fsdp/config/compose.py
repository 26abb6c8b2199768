"""From the command line to a validated `BenchmarkConfig`: Hydra's compose API over `conf/`
onto `schema.py`; `-m` sweeps expanded by Hydra's override parser; `--config FILE` as YAML."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dcp_fsdp.config.conf_dir import conf_dir
from dcp_fsdp.config.schema import BenchmarkConfig, iter_settings, to_config
from dcp_fsdp.config.validate import (apply_config_dtype, apply_protocol, check_model_settings,
                                      check_region, check_setting_name, check_storage_settings,
                                      check_suffix, did_you_mean, model_config_names, validate)
from dcp_fsdp.errors import UserError

CONF_DIR = conf_dir()


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Hydra multirun semantics: the cartesian product of every swept override."""
    choices = [[f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()]
               if override.is_sweep_override() else [override.input_line or ""]
               for override in OverridesParser.create().parse_overrides(overrides)]
    return [list(combination) for combination in itertools.product(*choices)]


def config_file_overrides(paths: list[str]) -> list[str]:
    """The settings of `--config FILE` files (YAML: the command line's keys, nested or dotted),
    as overrides to place before the command line's (which wins), in the files' order."""
    def flatten(node: dict, prefix: str = "") -> Iterator[str]:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                yield from flatten(value, f"{name}.")
            elif isinstance(value, list):
                yield f"{name}=[{','.join(str(v) for v in value)}]"
            elif value is None:
                yield f"{name}=null"
            else:
                yield f"{name}={str(value).lower() if isinstance(value, bool) else value}"

    overrides: list[str] = []
    for path in paths:
        try:
            with open(path) as source:
                content = yaml.safe_load(source)
        except OSError as error:
            raise UserError(f"--config {path}: cannot read it ({error.strerror or error}); "
                            "check the path and its permissions") from None
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise UserError(f"--config {path}: not valid YAML{line}; fix the file") from None
        if content is not None and not isinstance(content, dict):
            raise UserError(f"--config {path}: expected a mapping of settings (key: value), "
                            f"found {type(content).__name__}")
        overrides += flatten(content or {})
    return overrides


def compose(command: str, overrides: list[str], named: str | None = None) -> BenchmarkConfig:
    """The validated BenchmarkConfig for a command and overrides, or UserError. `named`: the
    command the user typed, where it composes as `command` (plan as save): errors name it."""
    given = check_overrides(overrides)
    ConfigStore.instance().store(name="base_config", node=BenchmarkConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name="config",
                                     overrides=[f"command={command.replace('-', '_')}", *overrides])
        cfg = to_config(composed)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise UserError(one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()
    apply_protocol(cfg, given, named)  # (before validate: iterations sizes the suffixes)
    validate(cfg, CONF_DIR)
    check_storage_settings(cfg, given)
    check_model_settings(cfg, given)
    apply_config_dtype(cfg, given)  # after the check: model.config alone names the model
    return cfg


def check_overrides(overrides: list[str]) -> set[str]:
    """The setting names the overrides give, after refusing any that names no setting (a
    misspelt `+key=value` would otherwise be added and ignored)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as error:  # Hydra's parser raises its own exception types
        raise UserError(parse_error_line(overrides, error)) from None
    given = set()
    for override in parsed:
        if override.is_sweep_override():
            raise UserError(_sweep_line(override.input_line or ""))
        key, value = override.key_or_group, override.value() if not override.is_delete() else None
        check_setting_name(override.get_key_element(), key, override.package)
        if key == "model" and value is not None:
            presets = model_config_names(CONF_DIR)
            if value not in presets:
                raise UserError(f"model={value}: unknown preset{did_you_mean(str(value), presets)}; "
                                f"choose one of {', '.join(presets)}")
        if (key in _settings_of_type("bool") and isinstance(value, (int, float))
                and not isinstance(value, bool) and value not in (0, 1)):
            # OmegaConf would read any other number as true: refuse, do not guess
            raise UserError(f"{key}={value}: give true or false")
        if key == "storage" and value is not None and value not in ("s3", "fs"):
            raise UserError(f"storage={value}: unknown storage; choose s3 or fs")
        given.add(key)
    return given


def _sweep_line(line: str) -> str:
    """A sweep given without -m; where a comma in a text made it one, also how to quote it."""
    key, _, value = line.partition("=")
    single = ""
    if "," in value and key.lstrip("+~") in _settings_of_type("str"):
        quote = '"' if "'" in value else "'"
        single = (f"; one value holding a comma (a path) must be quoted: write it as "
                  f"{key}={quote}{value}{quote}, in the shell: \"{key}={quote}{value}{quote}\"")
    return (f"{line}: several values need -m (multirun): add -m to run one job per value, or "
            f"give one value{single}")


def _settings_of_type(type_name: str) -> set[str]:
    return {name for name, kind, _, _ in iter_settings() if kind == type_name}


def parse_error_line(overrides: list[str], error: BaseException) -> str:
    """Hydra's parser error as one line naming the override it could not read, with the
    fix for the usual cause: spaces, quotes or non-ASCII letters in an unquoted value."""
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except Exception:  # Hydra's parser raises its own exception types
            key, _, value = override.partition("=")
            if not _ or not value:
                return f"'{override}': cannot parse it; write settings as key=value"
            if value.count("[") != value.count("]") or value.count("{") != value.count("}"):
                return (f"{key}: cannot parse the value {value!r} (its brackets do not pair "
                        f"up); write a list as {key}=[a,b]; a text must be quoted: {key}='{value}'")
            refused = _refused_anyway(key, value)
            if refused:
                return refused
            quote = '"' if "'" in value else "'"
            return (f"{key}: cannot parse the value {value!r} (non-ASCII letters and ~ ' ( ) "
                    f"[ ] {{ }} = # & must be quoted); write it as {key}={quote}{value}{quote}, "
                    f"in the shell: \"{key}={quote}{value}{quote}\"")
    return f"cannot parse overrides: {one_line(error)}"


def _refused_anyway(key: str, value: str) -> str | None:
    """The refusal a setting's own check gives a value Hydra cannot parse unquoted: quoting it
    would only lead to that refusal."""
    try:
        if key == "suffix":
            check_suffix(value)
        elif key == "storage.region":
            check_region(value, key)
    except UserError as refused:
        return str(refused)
    return None


_FIXES = (  # OmegaConf's words for a wrong type, and what to write instead
    ("converted to Integer", "give a whole number"),
    ("converted to Float", "give a number"),
    ("is not a valid bool", "give true or false"),
    ("is not a ListConfig", "give a list, e.g. 'KEY=[a,b]'"),
    ("expected one of", "choose one of those"),
)


def one_line(error: BaseException) -> str:
    """Hydra/OmegaConf errors as one line that names the setting and the fix."""
    cause = error.__cause__ or error
    text = " ".join(str(cause).split())
    key_match = re.search(r"full_key: (\S+)", text)
    key = key_match.group(1) if key_match else None
    text = text.split(" full_key:")[0]
    if "not in '" in text or "is not in struct" in text:
        name = key or text
        return (f"{name}: unknown setting; check the spelling against the README's Settings "
                "(or conf/config.yaml)")
    fix = next((fix for words, fix in _FIXES if words in text), None)
    if key:
        return f"{key}: {text.rstrip('.')}" + (f"; {fix.replace('KEY', key)}" if fix else "")
    return f"{' '.join(str(error).split())} (see the README's Settings)"
