"""The kit's user-facing lines in English and Chinese, from one catalog (kit.core.messages), in one chosen language.

The language is `KIT_LANG` (en | zh), else the project's `language` (`python -m kit project --language zh`,
`set_project(language="zh")`), else English. `t(key, **values)` is the key's line in that language, formatted with
str.format. What programs read (JSON reports, manifests, status codes) stays English whatever the language.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from kit.core.messages import MESSAGES
from kit.errors import InputError, KitError, set_language_lookup

LANGUAGES = ("en", "zh")
DEFAULT_LANGUAGE = "en"
ENV = "KIT_LANG"


def check_language(value: object, source: str) -> str:
    """`value` when it is a language of the kit, else an InputError in one line naming `source`."""
    if value in LANGUAGES:
        return str(value)
    env = os.environ.get(ENV, "").strip()  # the refusal's own language: KIT_LANG's when that one is valid
    said_in = env if env in LANGUAGES else DEFAULT_LANGUAGE
    raise InputError(t("language.unknown", _lang=said_in, value=value, source=source))


def language_and_source() -> Tuple[str, str]:
    """(language, where it came from: KIT_LANG, the project, or default)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        return check_language(env, ENV), ENV
    from kit.core.project import PROJECT, read_project

    value = read_project().get("language")
    if value is not None:
        return check_language(value, PROJECT), PROJECT
    return DEFAULT_LANGUAGE, "default"


def language() -> str:
    """The language the kit speaks in now (see the module)."""
    return language_and_source()[0]


def _safe_language() -> str:
    """The language, or English when the setting itself is the problem (an error line must still be written)."""
    try:
        return language()
    except KitError:
        return DEFAULT_LANGUAGE


def t(key: str, _lang: Optional[str] = None, **values: object) -> str:
    """The catalog's line `key` in the kit's language (or `_lang`), its {placeholders} filled from `values`."""
    return MESSAGES[key][_lang or language()].format(**values)


set_language_lookup(_safe_language)  # the notebook's one-line errors (kit.errors) take their prefix in it
