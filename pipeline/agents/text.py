"""Tokenising shared by the literature index (``tools``) and the gene index (``gene_ontology``),
kept apart so neither module has to import the other."""

from __future__ import annotations

import re

TOKEN = re.compile(r"[a-z0-9]+")
STOP = {"the", "of", "and", "in", "a", "to", "is", "for", "with", "on", "or", "by", "an", "as", "are", "be", "at", "does", "do",
        "was", "were"}


def tokens(text: str) -> list[str]:
    return [t for t in TOKEN.findall(text.lower()) if t not in STOP]
