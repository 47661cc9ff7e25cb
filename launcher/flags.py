"""horovodrun's flags on horolite-run, made from the settings declaration.

Every tunable flag comes from ``horolite.core.settings``: a flag sets its
``HOROLITE_*`` variable on every rank, a ``--config-file`` (horovodrun's YAML
keys) fills what the command line left unset. horovodrun flags that cannot
mean anything here (jsrun) stop the launch at once with the reason.
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, Mapping, Optional, Tuple

from horolite.core import settings

__all__ = ["add_setting_flags", "add_refused_flags", "setting_env", "apply_config_file",
           "REFUSED"]

# horovodrun flag -> (nargs, why horolite-run cannot do it).
REFUSED = {
    ("--jsrun",): (0, "horolite launches through mpirun or by itself (--gloo), not IBM's jsrun"),
}


def _dest(name: str) -> str:
    return "setting_" + name.lower()


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.help}")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("horovodrun flags that horolite-run refuses")
    for names, (nargs, why) in REFUSED.items():
        group.add_argument(*names, nargs=nargs, action=_Refuse, help=why,
                           dest="refused_" + names[0].lstrip("-").replace("-", "_"))


def _value_type(kind, unit: str):
    if isinstance(kind, tuple):
        return lambda text: str(text).upper() if kind[0].isupper() else str(text).lower()
    if kind is str:
        return str
    return non_negative(float if unit == "MiB" else kind)


def non_negative(number):
    """An argparse type: `number(text)`, refused when it does not parse or is negative."""
    def parse(text):
        try:
            value = number(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {number.__name__}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} must not be negative")
        return value
    parse.__name__ = number.__name__
    return parse


def _flag_specs():
    """(name, kind, flag, flag_false, unit, variable, help) for every flag of a setting."""
    for s in settings.SETTINGS:
        if s.scope == "rank" and (s.flag or s.flag_false):
            yield s.name, s.kind, s.flag, s.flag_false, s.flag_unit, s.variable, s.meaning
    for name, (instead, flag, _, kind) in settings.NOT_HONOURED.items():
        if flag:
            off = "--no-" + flag[2:] if kind is bool else ""
            yield name, kind, flag, off, "", "HOROVOD_" + name, f"accepted, no effect: {instead}"


# horovodrun's deprecated spellings (still accepted by 0.28.1): setting -> [(flag, value)].
_DEPRECATED = {"LOG_HIDE_TIME": [("--log-hide-timestamp", True), ("--no-log-hide-timestamp", False)]}


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag (or an on/off pair) per declared setting that has one."""
    group = parser.add_argument_group("settings (each sets a HOROLITE_* variable on every rank)")
    for name, kind, flag, flag_false, unit, variable, meaning in _flag_specs():
        help_text = f"{meaning.replace('%', '%%')} ({variable})"
        if kind is bool:
            pair = group.add_mutually_exclusive_group()
            for old_flag, value in _DEPRECATED.get(name, ()):
                pair.add_argument(old_flag, dest=_dest(name), action="store_const", const=value,
                                  default=None, help=argparse.SUPPRESS)
            if flag:
                pair.add_argument(flag, dest=_dest(name), action="store_const", const=True,
                                  default=None, help=help_text)
            if flag_false:
                pair.add_argument(flag_false, dest=_dest(name), action="store_const",
                                  const=False, default=None,
                                  help=help_text if not flag else argparse.SUPPRESS)
        else:
            choices = kind if isinstance(kind, tuple) else None
            group.add_argument(flag, dest=_dest(name), type=_value_type(kind, unit),
                               choices=choices, default=None, help=help_text)


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def setting_env(args: argparse.Namespace) -> Tuple[Tuple[str, str], ...]:
    """(variable, value) for every setting a flag or the config file gave."""
    env = []
    for name, kind, _, _, unit, variable, _ in _flag_specs():
        value = getattr(args, _dest(name), None)
        if value is None:
            continue
        if kind is bool:
            text = "1" if value else "0"
        elif unit == "MiB":
            text = str(int(value * 1024 * 1024))
        elif unit == "path":
            text = os.path.abspath(value)
        elif kind in (int, float):
            text = _number(value)
        else:
            text = str(value)
        env.append((variable, text))
    return tuple(env)


def _yaml_keys() -> Dict[Tuple[str, str], Tuple[str, bool]]:
    """(section, key) of horovodrun's config file -> (setting name, inverted)."""
    keys = {}
    for s in settings.SETTINGS:
        if s.yaml:
            section, key = s.yaml.split(".")
            keys[(section, key.lstrip("!"))] = (s.name, key.startswith("!"))
    for name, (_, _, yaml_key, _) in settings.NOT_HONOURED.items():
        if yaml_key:
            section, key = yaml_key.split(".")
            keys[(section, key)] = (name, False)
    return keys


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill the settings the command line left unset from horovodrun's YAML --config-file."""
    path = args.config_file
    try:
        import yaml
    except ImportError:
        parser.error("--config-file needs PyYAML: pip install pyyaml")
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f) or {}
    except OSError as e:
        parser.error(f"cannot read --config-file {path}: {e.strerror}")
    except yaml.YAMLError as e:
        parser.error(f"--config-file {path} is not valid YAML: {e}")
    if not isinstance(document, dict):
        parser.error(f"--config-file {path}: expected a mapping of sections, got "
                     f"{type(document).__name__}")
    keys = _yaml_keys()
    specs = {name: (kind, unit) for name, kind, _, _, unit, _, _ in _flag_specs()}
    for section, entries in document.items():
        if section == "controller":
            if str(entries).lower() not in ("mpi", "gloo"):
                parser.error(f"--config-file {path}: controller {entries!r} is not supported: "
                             "horolite runs over MPI, or without it with gloo")
            if str(entries).lower() == "gloo" and not getattr(args, "mpi", False):
                args.gloo = True  # --mpi on the command line wins
            continue
        if not isinstance(entries, dict):
            parser.error(f"--config-file {path}: section {section!r} must be a mapping")
        for key, value in entries.items():
            if (section, key) == ("library_options", "gloo_timeout_seconds"):
                if getattr(args, "gloo_timeout_seconds", None) is None and value is not None:
                    try:
                        args.gloo_timeout_seconds = non_negative(float)(value)
                        if not args.gloo_timeout_seconds:
                            raise argparse.ArgumentTypeError("must be above 0")
                    except argparse.ArgumentTypeError as e:
                        parser.error(f"--config-file {path}: {section}.{key}={value!r}: {e}")
                continue
            if (section, key) not in keys:
                parser.error(f"--config-file {path}: unknown key {section}.{key} "
                             "(horovodrun's keys are listed in docs/launcher.md)")
            name, inverted = keys[(section, key)]
            if getattr(args, _dest(name), None) is not None:
                continue  # the command line wins
            if value is None:
                continue
            kind, unit = specs[name]
            try:
                if kind is bool:
                    typed = settings.Setting(name, bool, False, "").parse(str(value),
                                                                          f"{section}.{key}")
                    typed = (not typed) if inverted else typed
                else:
                    typed = _value_type(kind, unit)(value)
                    if isinstance(kind, tuple) and typed not in kind:
                        raise ValueError(f"must be one of {', '.join(kind)}")
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"--config-file {path}: {section}.{key}={value!r}: {e}")
            setattr(args, _dest(name), typed)


def launcher_value(name: str, flag_value, environ: Mapping[str, str], default):
    """A launcher setting: the flag, else HOROLITE_/HOROVOD_<name>, else the default."""
    if flag_value is not None:
        return flag_value
    raw = settings.env_value(name, environ)
    return settings.BY_NAME[name].parse(raw) if raw not in (None, "") else default


def ssh_args(port: Optional[int], identity: Optional[str]) -> str:
    """What horovodrun's -p/-i become: options for the ssh that starts remote ranks."""
    parts = []
    if port is not None:
        parts += ["-p", str(port)]
    if identity:
        parts += ["-i", os.path.abspath(os.path.expanduser(identity))]
    return " ".join(parts)
