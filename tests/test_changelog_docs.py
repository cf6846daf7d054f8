"""The docs' known-answer lines against the shipped changelog pages (issue 53, item 6): docs/changelog.md and
docs/upgrade.md called 0.30.6 -> 0.31.2 BIT-FOR-BIT while both pages opened with ANSWER-CHANGING (the tier's state
sweep): one machine's class was given as the pair's. Every class the docs give a release pair names the machine
it is from and is that machine's cell in the shipped index; the README's "What will upgrading do" paragraph is
the index's column of the machine it names."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "docs" / "changelog"
CLASS = r"(BIT-FOR-BIT|ROUNDOFF|ANSWER-CHANGING)"
V = r"\d+\.\d+\.\d+"
PAIR = re.compile(rf"(?P<lm>mlx-lm )?(?P<a>{V}(?:\+lm{V})?) (?:→|->) (?P<b>{V}(?:\+lm{V})?)(?: with mlx (?P<mlx>{V}))?")
MACHINE = re.compile(r"(?P<m>[A-Za-z0-9][\w.-]*) \((?P<backend>cpu|metal|cuda)\)")
CLAIM = re.compile(rf"{CLASS}(?P<how> on (?P<where>[\w.-]+@\w+)| by `upgrade`| predicted for (?P<chips>M\d(?:\.\.M\d)?))?")


def index():
    """{(old, new): {"machine (backend)": class}} from the shipped index's measured columns."""
    text = (SHIPPED / "index.md").read_text()
    head = text.split("| release | from | ")[1].split(" |\n")[0].split(" | ")
    out = {}
    for line in text.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| 0.") or not cells[1].startswith("["):
            continue
        new, old = cells[0].lstrip("| "), cells[1].split("](")[0].lstrip("[")
        out[(old, new)] = {col: cells[i + 2].strip(" |").split(" (")[0] for i, col in enumerate(head)}
    return out


def chips(text):
    """'M1..M4' -> the predicted columns M1, M2, M3, M4 of the index."""
    a, _, b = text.partition("..")
    return [f"M{i} (predicted)" for i in range(int(a[1:]), int((b or a)[1:]) + 1)]
    return out


def split(label):
    mlx, _, lm = label.partition("+lm")
    return mlx, lm


def pages_of(pair, pairs):
    """The shipped pairs a doc's pair names: an mlx pair by its mlx versions, an mlx-lm pair (``mlx-lm A → B with
    mlx M``) by its mlx-lm versions on that mlx."""
    if pair.group("lm"):
        want = lambda o, n: split(o) == (pair.group("mlx"), pair.group("a")) and split(n) == (pair.group("mlx"),
                                                                                               pair.group("b"))
    else:
        want = lambda o, n: split(o)[0] == pair.group("a") and split(n)[0] == pair.group("b") and \
            split(o)[0] != split(n)[0]
    return [p for p in pairs if want(*p)]


def claims(text):
    """(pair match, [(class, machine or None, how)]) per clause of ``text`` that names a release pair and a class.
    Code blocks and spans are left out (a quoted cell is not a claim); a machine is written "name (backend)"; what is in
    parentheses after that is left out (counts and mlx-lm versions quoted beside a claim are not pairs)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a command's printed lines: its own words, not a claim
    text = re.sub(r"`[^`]*`", lambda m: m.group(0) if m.group(0) == "`upgrade`" else "", text.replace("\n", " "))
    text = MACHINE.sub(lambda m: f"{m.group('m')}@{m.group('backend')}", text)
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    out = []
    for clause in re.split(r";|\.\s|\|", text):
        pairs = list(PAIR.finditer(clause))
        said = [(m.group(1), m.group("where"), m.group("how")) for m in CLAIM.finditer(clause)]
        if pairs and said:
            out += [(p, said) for p in pairs]
    return out


DOCS = ["docs/changelog.md", "docs/upgrade.md", "docs/measured-figures.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_class_the_docs_give_a_pair_is_its_machines_cell_in_the_shipped_pages(doc):
    if not (SHIPPED / "index.md").is_file():
        pytest.skip("no shipped pages")
    shipped = index()
    found = claims((ROOT / doc).read_text())
    assert found, f"{doc}: no known-answer line found"
    for pair, said in found:
        pages = pages_of(pair, shipped)
        for cls, where, how in said:
            assert how, f"{doc}: {pair.group(0)} {cls}: a class without the machine it is from"
            if how.startswith(" predicted for "):  # a prediction: the chips' columns
                assert len(pages) == 1, f"{doc}: {pair.group(0)} names no one shipped page ({pages})"
                for col in chips(how[len(" predicted for "):]):
                    assert shipped[pages[0]].get(col) == cls, f"{doc}: {pair.group(0)} {cls} on {col}: " \
                                                              f"{shipped[pages[0]].get(col)}"
                continue
            if where is None:  # `upgrade`'s own figures on the documented machine: no page holds them
                continue
            machine = where.replace("@", " (") + ")"
            assert len(pages) == 1, f"{doc}: {pair.group(0)} names no one shipped page ({pages})"
            got = shipped[pages[0]].get(machine)
            assert got == cls, f"{doc}: {pair.group(0)} {cls} on {machine}, the shipped page: {got}"


def test_a_pairs_class_without_its_machine_is_caught():
    """The checker itself: the old line of docs/changelog.md is refused, the new form is read."""
    (old,) = claims("0.30.6 → 0.31.2 BIT-FOR-BIT (263 figures).")[:1]
    assert old[1] == [("BIT-FOR-BIT", None, None)]
    new = claims("0.30.6 → 0.31.2 and 0.31.2 → 0.32.4 BIT-FOR-BIT on reference-linux-cpu (cpu) (263 figures, "
                 "mlx-lm 0.31.2 → 0.31.3) and ANSWER-CHANGING on reference-linux-cpu-tier (cpu).")
    assert [p.group(0) for p, _ in new] == ["0.30.6 → 0.31.2", "0.31.2 → 0.32.4"]
    assert new[0][1] == [("BIT-FOR-BIT", "reference-linux-cpu@cpu", " on reference-linux-cpu@cpu"),
                         ("ANSWER-CHANGING", "reference-linux-cpu-tier@cpu", " on reference-linux-cpu-tier@cpu")]


def test_the_readmes_upgrading_paragraph_is_the_column_of_the_machine_it_names():
    if not (SHIPPED / "index.md").is_file():
        pytest.skip("no shipped pages")
    readme = (ROOT / "README.md").read_text()
    para = readme.split("**What will upgrading do to my model?**")[1].split("\n\n")[0].replace("\n", " ")
    (machine,) = {m.group(0) for m in MACHINE.finditer(para)}
    once = re.search(rf"mlx changed the answers once, at \*\*({V})\*\*", para).group(1)
    others = int(re.search(r"each of the other (\d+) mlx releases that kept its mlx-lm is BIT-FOR-BIT", para).group(1))
    text = (SHIPPED / "index.md").read_text()
    col = text.split("| release | from | ")[1].split(" |\n")[0].split(" | ").index(machine) + 2
    answer, bit = [], []
    for line in text.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| 0.") or not cells[1].startswith("["):
            continue
        cell = cells[col].strip(" |")
        new, old = cells[0].lstrip("| "), cells[1].split("](")[0].lstrip("[")
        if "mlx-lm" in cell or split(old)[0] == split(new)[0]:  # mlx-lm changed: not an mlx-only pair
            continue
        (answer if cell == "ANSWER-CHANGING" else bit if cell == "BIT-FOR-BIT" else []).append((old, new))
    assert [new for _, new in answer] == [once], (machine, answer)
    assert len(bit) == others, (machine, bit)
