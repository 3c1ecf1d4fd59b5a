"""Gene Ontology knowledge behind ``lookup_gene`` / ``lookup_protein``.

The data is Bioconductor's two annotation databases, both plain SQLite: ``org.Hs.eg.db`` (NCBI
Gene: symbols, names, aliases, UniProt accessions and GO annotations with evidence codes) and
``GO.db`` (the GO terms). Debian packages them (``r-bioc-org.hs.eg.db``, ``r-bioc-go.db``), so a
``deb:`` source works on a host that reaches only package mirrors; a local path, http(s):// or
s3:// work too. ``build-index`` flattens them into ``genes.jsonl`` (one human gene per line, its
best-supported GO terms first) so the tools need no SQLite and the DVC out is self-contained.
"""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import sqlite3
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.agents.text import STOP as TOOL_STOP
from pipeline.data.sources import read_bytes
from pipeline.io import atomic_path

ASPECTS = {"go_bp": "process", "go_mf": "function", "go_cc": "component"}
# GO evidence codes backed by an experiment or a curator (the rest are inferred, e.g. IEA)
CURATED = {"EXP", "IDA", "IPI", "IMP", "IGI", "IEP", "HTP", "HDA", "HMP", "HGI", "HEP", "TAS", "IC"}
TERMS_PER_ASPECT = 6
SWISS_PROT = re.compile(r"^[OPQ][0-9][A-Z0-9]{3}[0-9]$")  # reviewed UniProt accessions; the rest are TrEMBL
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
STOP = TOOL_STOP | {"gene", "genes", "protein", "proteins", "role", "human", "expression", "level", "levels"}


class KnowledgeError(RuntimeError):
    pass


def resolve(source: str, cache_dir: Path) -> Path:
    """A local file for ``source``: ``deb:<package>[=<version>]/<file>``, a path, http(s):// or s3://."""
    if source.startswith("deb:"):
        package, _, member = source[4:].partition("/")
        if not package or not member:
            raise KnowledgeError(f"{source}: expected deb:<package>[=<version>]/<file inside the package>")
        target = cache_dir / re.sub(r"[^A-Za-z0-9._-]", "_", package) / member
        if not target.exists():
            _extract_from_deb(package, member, target)
        return target
    if "://" in source:
        target = cache_dir / "url" / f"{hashlib.sha256(source.encode()).hexdigest()[:16]}-{Path(source).name}"
        if not target.exists():
            with atomic_path(target) as tmp:
                tmp.write_bytes(read_bytes(source, timeout_s=600))
        return target
    path = Path(source).expanduser()
    if not path.exists():
        raise KnowledgeError(f"{path}: file not found")
    return path


def _extract_from_deb(package: str, member: str, target: Path) -> None:
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise KnowledgeError(f"deb:{package}: apt-get/dpkg-deb not found; point agents.knowledge at local .sqlite files instead")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        got = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True, check=False)
        debs = list(Path(tmp).glob("*.deb"))
        if got.returncode != 0 or not debs:
            raise KnowledgeError(f"deb:{package}: apt-get download failed: {(got.stderr or got.stdout).strip()[-400:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), f"{tmp}/root"], check=True)
        found = sorted(Path(tmp, "root").rglob(member))
        if not found:
            raise KnowledgeError(f"deb:{package}: no file named {member} in the package")
        found[0].replace(target)  # same filesystem: an atomic rename, so a half-written file is never cached


def build_gene_table(org_db: Path, go_db: Path) -> list[dict[str, Any]]:
    """One record per human gene with GO annotations, curated-evidence terms first."""
    con = sqlite3.connect(f"file:{org_db}?mode=ro", uri=True)  # uri=True also lets ATTACH take a read-only URI
    try:
        con.execute("ATTACH DATABASE ? AS go", (f"file:{go_db}?mode=ro",))
        genes = {gid: {"symbol": sym, "name": name, "entrez": entrez, "aliases": [], "uniprot": []}
                 for gid, sym, name, entrez in con.execute(
                     "SELECT g._id, i.symbol, i.gene_name, g.gene_id FROM genes g JOIN gene_info i ON i._id = g._id")}
        for gid, alias in con.execute("SELECT _id, alias_symbol FROM alias ORDER BY _id, alias_symbol"):
            if gid in genes and alias != genes[gid]["symbol"]:
                genes[gid]["aliases"].append(alias)
        for gid, acc in con.execute("SELECT _id, uniprot_id FROM uniprot ORDER BY _id, uniprot_id"):
            if gid in genes:
                genes[gid]["uniprot"].append(acc)
        annotated: set[int] = set()
        for table, aspect in ASPECTS.items():
            rows: dict[int, dict[str, tuple[int, str]]] = defaultdict(dict)
            sql = (f"SELECT a._id, a.go_id, t.term, a.evidence FROM {table} a "  # noqa: S608 - table from a fixed list
                   "JOIN go.go_term t ON t.go_id = a.go_id")
            for gid, go_id, term, evidence in con.execute(sql):
                rank = 0 if evidence in CURATED else 1
                best = rows[gid].get(go_id)
                if best is None or rank < best[0]:
                    rows[gid][go_id] = (rank, term)
            for gid, terms in rows.items():
                if gid in genes:
                    ordered = sorted(terms.items(), key=lambda kv: (kv[1][0], kv[1][1]))
                    genes[gid][aspect] = [{"id": go_id, "term": term, "curated": rank == 0} for go_id, (rank, term) in ordered]
                    annotated.add(gid)
    finally:
        con.close()
    out = []
    for gid in sorted(annotated):
        gene = genes[gid]
        gene["annotations"] = sum(len(gene.get(a, [])) for a in ASPECTS.values())
        for aspect in ASPECTS.values():
            gene[aspect] = gene.get(aspect, [])[:TERMS_PER_ASPECT]
        gene["uniprot"] = sorted(gene["uniprot"], key=lambda acc: (not SWISS_PROT.match(acc), acc))[:4]
        gene["aliases"] = gene["aliases"][:8]
        out.append(gene)
    if not out:
        raise KnowledgeError(f"{org_db} + {go_db}: no gene carries a GO annotation; wrong files?")
    return out


def _words(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text) if w.lower() not in STOP]


@dataclass
class GeneIndex:
    """Symbol/alias/UniProt exact matches, then IDF-weighted overlap with the official gene name."""

    genes: list[dict[str, Any]]
    by_id: dict[str, list[int]] = field(default_factory=dict)
    by_word: dict[str, list[int]] = field(default_factory=dict)
    idf: dict[str, float] = field(default_factory=dict)
    name_words: list[set[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids: dict[str, list[int]] = defaultdict(list)
        words: dict[str, list[int]] = defaultdict(list)
        self.name_words = [set(_words(g["name"])) for g in self.genes]
        for i, g in enumerate(self.genes):
            for key in {g["symbol"], *g["aliases"], *g["uniprot"]}:
                ids[key.upper()].append(i)
            for w in self.name_words[i]:
                words[w].append(i)
        self.by_id, self.by_word = dict(ids), dict(words)
        n = len(self.genes)
        self.idf = {w: math.log(1 + n / len(ix)) for w, ix in words.items()}

    def search(self, query: str, k: int = 3) -> list[dict[str, Any]]:
        raw = WORD.findall(query)
        single = len(raw) == 1
        scores: dict[int, float] = defaultdict(float)
        for tok in raw:
            # an identifier looks like one (TP53, IL6, P04637, BRCA1) or is the whole query; this keeps
            # words that are also aliases ("can", "E4" of "apolipoprotein E4") from matching in sentences
            if single or (len(tok) > 2 and (tok.isupper() or any(c.isdigit() for c in tok))):
                for i in self.by_id.get(tok.upper(), []):
                    official = tok.upper() in (self.genes[i]["symbol"].upper(), *(u.upper() for u in self.genes[i]["uniprot"]))
                    scores[i] += 100.0 if official else 50.0
        q = set(_words(query))
        overlap: dict[int, float] = defaultdict(float)
        for w in q:
            for i in self.by_word.get(w, []):
                overlap[i] += self.idf[w]
        for i, hit in overlap.items():
            # series letters ("apolipoprotein E") count only when asked for: "apolipoprotein E4" is not about D
            name = {w for w in self.name_words[i] if len(w) > 1 or w in q}
            name_weight = sum(self.idf.get(w, 0.0) for w in name) or 1.0
            scores[i] += hit * (hit / name_weight)  # how much of the query it explains x how much of the name is asked for
        ranked = sorted(scores, key=lambda i: (-scores[i], -self.genes[i]["annotations"], self.genes[i]["symbol"]))
        return [self.genes[i] for i in ranked[:k]]


def describe(gene: dict[str, Any], aspects: tuple[str, ...]) -> str:
    ids = f"NCBI Gene {gene['entrez']}" + (f"; UniProt {', '.join(gene['uniprot'][:2])}" if gene["uniprot"] else "")
    parts = [f"{a}: {', '.join(t['term'] for t in gene[a][:4])}" for a in aspects if gene.get(a)]
    return f"{gene['symbol']} ({gene['name']}; {ids}). GO {'; '.join(parts) or 'no annotations'}"
