"""Offline tools of the junior researchers, backed by files the ``build-index`` stage writes.

- ``search_literature``: BM25 over the PubMedQA abstracts of the train split (validation and test
  abstracts are left out, so no split's score depends on searching its own answers; every task is
  handed its own abstract instead); returns PMIDs and passages.
- ``lookup_gene`` / ``lookup_protein``: human genes and their Gene Ontology annotations (symbol,
  alias, UniProt accession or name match; ``gene_ontology.py``), plus the MeSH gene/protein headings
  of the same abstracts (how many abstracts carry them, example PMIDs, co-occurring headings), which
  ties a gene to this corpus. Without GO data (``agents.knowledge.org_db: null``) only MeSH answers.

A tool never raises into the graph: errors come back as ``ok=False`` with a message for the agent.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from rank_bm25 import BM25Okapi

from pipeline.agents.gene_ontology import GeneIndex, describe
from pipeline.agents.text import tokens
from pipeline.io import atomic_dir

GENE_WORDS = re.compile(r"\b(genes?|genetic|genotype|allele|alleles|polymorphism|mutation|dna|rna|chromosom\w*|genom\w*|hla)\b",
                        re.I)
PROTEIN_WORDS = re.compile(r"(protein|receptor|enzyme|kinase|antibod|hormone|factor|peptide|insulin|collagen|cytokine|interleukin"
                           r"|ase\b|ases\b|globulin|antigen)", re.I)


@dataclass
class ToolResult:
    ok: bool
    text: str
    data: Any = None


class Toolbox:
    def __init__(self, index_dir: str | Path, top_k: int = 3) -> None:
        self.index_dir = Path(index_dir)
        self.top_k = top_k

    @cached_property
    def corpus(self) -> list[dict[str, Any]]:
        path = self.index_dir / "corpus.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path}: literature index missing; run `python -m pipeline build-index`")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @cached_property
    def bm25(self) -> Any:
        return BM25Okapi([tokens(d["title"] + " " + d["text"]) for d in self.corpus])

    @cached_property
    def mesh(self) -> dict[str, Any]:
        return json.loads((self.index_dir / "mesh.json").read_text())

    @cached_property
    def genes(self) -> Any:
        path = self.index_dir / "genes.jsonl"
        return GeneIndex([json.loads(line) for line in path.open()]) if path.exists() else None

    def call(self, tool: str, query: str) -> ToolResult:
        fn = {"search_literature": self.search_literature, "lookup_gene": self.lookup_gene,
              "lookup_protein": self.lookup_protein}.get(tool)
        if fn is None:
            return ToolResult(False, f"unknown tool '{tool}'")
        if not query.strip():
            return ToolResult(False, f"{tool}: empty query")
        try:
            return fn(query)
        except Exception as exc:
            return ToolResult(False, f"{tool} failed: {type(exc).__name__}: {exc}")

    def search_literature(self, query: str) -> ToolResult:
        scores = self.bm25.get_scores(tokens(query))
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[: self.top_k]
        hits = [{"pmid": self.corpus[i]["pmid"], "score": round(float(scores[i]), 3), "passage": self.corpus[i]["text"][:300]}
                for i in best if scores[i] > 0]
        if not hits:
            return ToolResult(True, f"no abstracts match '{query}'", [])
        return ToolResult(True, "\n".join(f"PMID {h['pmid']}: {h['passage']}" for h in hits), hits)

    def _lookup(self, kind: str, query: str, aspects: tuple[str, ...]) -> ToolResult:
        lines: list[str] = []
        data: dict[str, list[Any]] = {"genes": [], "mesh": []}
        if self.genes is not None:
            for gene in self.genes.search(query, self.top_k):
                lines.append(describe(gene, aspects))
                data["genes"].append({**{k: gene[k] for k in ("symbol", "name", "entrez", "uniprot")},
                                      **{a: [t["id"] for t in gene[a]] for a in aspects}})
        table: dict[str, dict[str, Any]] = self.mesh[kind]
        q = set(tokens(query))
        ranked = sorted(((len(q & set(tokens(term))), entry["count"], term) for term, entry in table.items()), reverse=True)
        data["mesh"] = [{"heading": t, **table[t]} for overlap, _, t in ranked if overlap][:3]
        lines += [f"In this corpus, MeSH {r['heading']}: {r['count']} abstracts (e.g. PMID {', '.join(r['pmids'][:3])}); "
                  f"co-occurs with {', '.join(r['cooccurs'][:3])}" for r in data["mesh"]]
        if not lines:
            return ToolResult(True, f"no {kind[:-1]} matches '{query}'", data)
        return ToolResult(True, "\n".join(lines), data)

    def lookup_gene(self, query: str) -> ToolResult:
        return self._lookup("genes", query, ("process", "function", "component"))

    def lookup_protein(self, query: str) -> ToolResult:
        return self._lookup("proteins", query, ("function", "component", "process"))


def build_index(frames: list[Any], out_dir: Path, genes: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Write corpus.jsonl (one abstract per PMID), mesh.json (gene/protein headings) and, given GO
    records (``gene_ontology.build_gene_table``), genes.jsonl."""
    corpus: list[dict[str, Any]] = []
    gene: dict[str, Any] = {}
    protein: dict[str, Any] = {}
    df: Counter = Counter(m for frame in frames for ms in frame["meshes"] if ms is not None for m in set(ms))
    n_docs = sum(len(f) for f in frames)
    common = {m for m, c in df.items() if c > 0.1 * n_docs}  # check tags (Humans, Male, Aged...) say nothing
    for frame in frames:
        for _, row in frame.iterrows():
            pmid = str(row["id"])
            corpus.append({"pmid": pmid, "title": str(row["question"]), "text": " ".join(row["contexts"])})
            meshes = list(row["meshes"] if row["meshes"] is not None else [])
            for term in meshes:
                table = gene if GENE_WORDS.search(term) else protein if PROTEIN_WORDS.search(term) else None
                if table is None:
                    continue
                entry = table.setdefault(term, {"count": 0, "pmids": [], "co": Counter()})
                entry["count"] += 1
                entry["pmids"].append(pmid)
                entry["co"].update(m for m in meshes if m != term and m not in common)
    mesh = {kind: {t: {"count": e["count"], "pmids": e["pmids"][:10], "cooccurs": [m for m, _ in e["co"].most_common(5)]}
                   for t, e in sorted(table.items())} for kind, table in (("genes", gene), ("proteins", protein))}
    with atomic_dir(out_dir) as tmp:
        (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
        (tmp / "mesh.json").write_text(json.dumps(mesh, indent=1))
        if genes:
            (tmp / "genes.jsonl").write_text("".join(json.dumps(g) + "\n" for g in genes))
    return {"abstracts": len(corpus), "gene_headings": len(gene), "protein_headings": len(protein), "go_genes": len(genes or [])}


def timed_call(box: Toolbox, sender: str, tool: str, query: str, spans: list[dict[str, Any]]) -> ToolResult:
    t0 = time.perf_counter()
    result = box.call(tool, query)
    spans.append({"kind": "tool", "name": tool, "data": {"sender": sender, "args": {"query": query}, "ok": result.ok,
                                                           "result": result.text[:1200], "latency_s": time.perf_counter() - t0}})
    spans.append({"kind": "reward", "name": f"{sender}.tool_success", "data": {
        "value": 1.0 if result.ok else 0.0, "kind": "intermediate",
        "reason": f"{tool}: {'ok' if result.ok else result.text[:200]}"}})
    return result
