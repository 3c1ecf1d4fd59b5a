"""Gene Ontology lookups: the table built from Bioconductor-schema SQLite files, and the tools on it.

The fixture databases use the exact tables and columns of org.Hs.eg.db / GO.db (the real ones are
50 MB of downloads; `build-index` in the pipeline integration test uses them), with real records.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from pipeline.agents.gene_ontology import KnowledgeError, build_gene_table, resolve
from pipeline.agents.tools import Toolbox, build_index

GENES = [  # _id, entrez, symbol, name, aliases, uniprot
    (1, "7157", "TP53", "tumor protein p53", ["P53", "LFS1"], ["A0A087WT22", "P04637"]),
    (2, "3630", "INS", "insulin", ["IDDM2"], ["P01308"]),
    (3, "3643", "INSR", "insulin receptor", ["CD220"], ["P06213"]),
    (4, "1401", "CRP", "C-reactive protein", ["PTX1"], ["P02741"]),
    (6, "348", "APOE", "apolipoprotein E", ["AD2"], ["P02649"]),
    (7, "10075", "UBE4B", "ubiquitination factor E4B", ["E4"], ["O95155"]),
    (8, "347", "APOD", "apolipoprotein D", [], ["P05090"]),
    (5, "9999", "NOGO", "uncharacterised locus", [], []),  # no GO annotation: left out
]
TERMS = [("GO:0006915", "apoptotic process", "BP"), ("GO:0003700", "DNA-binding transcription factor activity", "MF"),
         ("GO:0005634", "nucleus", "CC"), ("GO:0005179", "hormone activity", "MF"), ("GO:0005615", "extracellular space", "CC"),
         ("GO:0004714", "transmembrane receptor protein tyrosine kinase activity", "MF"), ("GO:0006953", "acute-phase response", "BP")]
ANNOTATIONS = {"go_bp": [(1, "GO:0006915", "IEA"), (1, "GO:0006915", "IDA"), (4, "GO:0006953", "IDA")],
               "go_mf": [(1, "GO:0003700", "IDA"), (2, "GO:0005179", "TAS"), (3, "GO:0004714", "IDA")],
               "go_cc": [(1, "GO:0005634", "IDA"), (2, "GO:0005615", "IEA"), (4, "GO:0005615", "IDA"), (6, "GO:0005615", "IDA"),
                         (6, "GO:0005634", "IEA"), (7, "GO:0005634", "IDA"), (8, "GO:0005615", "IDA")]}


def _bioconductor_dbs(root: Path) -> tuple[Path, Path]:
    org, go = root / "org.Hs.eg.sqlite", root / "GO.sqlite"
    with sqlite3.connect(org) as con:
        con.executescript("""
            CREATE TABLE genes (_id INTEGER PRIMARY KEY, gene_id VARCHAR(10) NOT NULL UNIQUE);
            CREATE TABLE gene_info (_id INTEGER NOT NULL UNIQUE, gene_name VARCHAR(255) NOT NULL, symbol VARCHAR(80) NOT NULL);
            CREATE TABLE alias (_id INTEGER NOT NULL, alias_symbol VARCHAR(80) NOT NULL);
            CREATE TABLE uniprot (_id INTEGER NOT NULL, uniprot_id VARCHAR(20) NOT NULL);
            CREATE TABLE go_bp (_id INTEGER NOT NULL, go_id CHAR(10) NOT NULL, evidence CHAR(3) NOT NULL);
            CREATE TABLE go_mf (_id INTEGER NOT NULL, go_id CHAR(10) NOT NULL, evidence CHAR(3) NOT NULL);
            CREATE TABLE go_cc (_id INTEGER NOT NULL, go_id CHAR(10) NOT NULL, evidence CHAR(3) NOT NULL);""")
        for gid, entrez, symbol, name, aliases, uniprot in GENES:
            con.execute("INSERT INTO genes VALUES (?, ?)", (gid, entrez))
            con.execute("INSERT INTO gene_info VALUES (?, ?, ?)", (gid, name, symbol))
            con.executemany("INSERT INTO alias VALUES (?, ?)", [(gid, a) for a in aliases])
            con.executemany("INSERT INTO uniprot VALUES (?, ?)", [(gid, u) for u in uniprot])
        for table, rows in ANNOTATIONS.items():
            con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?)", rows)
    with sqlite3.connect(go) as con:
        con.execute("CREATE TABLE go_term (_id INTEGER PRIMARY KEY, go_id CHAR(10) NOT NULL UNIQUE, term VARCHAR(255) NOT NULL,"
                    " ontology VARCHAR(9) NOT NULL, definition TEXT NULL)")
        con.executemany("INSERT INTO go_term (go_id, term, ontology) VALUES (?, ?, ?)", TERMS)
    return org, go


@pytest.fixture
def toolbox(tmp_path: Path) -> Toolbox:
    genes = build_gene_table(*_bioconductor_dbs(tmp_path))
    frame = pd.DataFrame([{"id": "1", "question": "Is p53 mutated in tumours?", "contexts": ["TP53 mutations were frequent."],
                           "meshes": ["Genes, p53", "Tumor Suppressor Protein p53", "Humans"]}])
    stats = build_index([frame], tmp_path / "index", genes)
    assert stats["go_genes"] == 7
    return Toolbox(tmp_path / "index", top_k=2)


def test_table_keeps_annotated_genes_with_curated_terms_first(tmp_path: Path) -> None:
    genes = {g["symbol"]: g for g in build_gene_table(*_bioconductor_dbs(tmp_path))}
    assert set(genes) == {"TP53", "INS", "INSR", "CRP", "APOE", "UBE4B", "APOD"}
    tp53 = genes["TP53"]
    assert tp53["entrez"] == "7157" and tp53["uniprot"] == ["P04637", "A0A087WT22"] and set(tp53["aliases"]) == {"P53", "LFS1"}
    assert tp53["process"] == [{"id": "GO:0006915", "term": "apoptotic process", "curated": True}]  # IDA beats IEA
    assert genes["INS"]["component"][0]["curated"] is False and genes["INS"]["annotations"] == 2


@pytest.mark.parametrize("query, symbol", [
    ("TP53", "TP53"), ("p53", "TP53"), ("role of P04637 in apoptosis", "TP53"), ("insulin receptor signalling", "INSR"),
    ("insulin", "INS"), ("C-reactive protein after surgery", "CRP"), ("apolipoprotein E4 in Alzheimer disease", "APOE"),
    ("apolipoprotein D", "APOD"),
])
def test_lookup_finds_the_gene(toolbox: Toolbox, query: str, symbol: str) -> None:
    result = toolbox.call("lookup_gene", query)
    assert result.ok and result.data["genes"][0]["symbol"] == symbol, result.text


def test_protein_lookup_reports_function_and_corpus_context(toolbox: Toolbox) -> None:
    result = toolbox.call("lookup_protein", "TP53")
    assert result.text.startswith("TP53 (tumor protein p53; NCBI Gene 7157; UniProt P04637, A0A087WT22). GO function: DNA-binding")
    assert result.data["genes"][0]["function"] == ["GO:0003700"]
    gene = toolbox.call("lookup_gene", "p53 tumor")
    assert "MeSH Genes, p53" in gene.text  # the corpus side still answers


def test_sentence_words_that_are_aliases_do_not_match(toolbox: Toolbox) -> None:
    result = toolbox.call("lookup_gene", "can statins lower risk")
    assert result.ok and result.data["genes"] == [] and result.text.startswith("no gene matches")


def test_sources_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(KnowledgeError, match="missing.sqlite: file not found"):
        resolve(str(tmp_path / "missing.sqlite"), tmp_path)
    with pytest.raises(KnowledgeError, match="deb:<package>"):
        resolve("deb:r-bioc-go.db", tmp_path)
    empty_org, go = _bioconductor_dbs(tmp_path)
    with sqlite3.connect(empty_org) as con:
        for table in ANNOTATIONS:
            con.execute(f"DELETE FROM {table}")
    with pytest.raises(KnowledgeError, match="no gene carries a GO annotation"):
        build_gene_table(empty_org, go)


def test_index_without_go_data_still_answers_from_mesh(tmp_path: Path) -> None:
    frame = pd.DataFrame([{"id": "1", "question": "q?", "contexts": ["text"], "meshes": ["Receptors, Insulin", "Humans"]}])
    build_index([frame], tmp_path / "index")
    result = Toolbox(tmp_path / "index").call("lookup_protein", "insulin receptor")
    assert result.ok and result.data["genes"] == [] and "Receptors, Insulin" in result.text
    assert json.loads((tmp_path / "index" / "mesh.json").read_text())["proteins"]


needs_apt = pytest.mark.skipif(not shutil.which("apt-get") or not shutil.which("dpkg-deb"), reason="no apt-get/dpkg-deb")


@needs_apt
def test_unknown_debian_package_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KnowledgeError, match="deb:r-bioc-no-such.db: apt-get download failed"):
        resolve("deb:r-bioc-no-such.db/x.sqlite", tmp_path)
    assert not list(tmp_path.rglob("x.sqlite"))


@needs_apt
@pytest.mark.slow
def test_debian_source_downloads_and_caches_the_real_go_db(tmp_path: Path) -> None:
    """The real GO.db package (12 MB from the Debian mirror): extracted once, then served from the cache."""
    path = resolve("deb:r-bioc-go.db=3.16.0-1/GO.sqlite", tmp_path)
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT term FROM go_term WHERE go_id = 'GO:0006915'").fetchone() == ("apoptotic process",)
    mtime = path.stat().st_mtime_ns
    assert resolve("deb:r-bioc-go.db=3.16.0-1/GO.sqlite", tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == ["GO.sqlite"]  # no temp files left beside it
