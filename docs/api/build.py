#!/usr/bin/env python3
"""docs/api/build.py — the API reference, generated from gpipe's docstrings and header comments.

    python3 docs/api/build.py           # writes docs/api/python.md and docs/api/cpp.md
    python3 docs/api/build.py --check   # writes nothing; fails when they are stale or anything warns

Run it from anywhere, with the gpipe package importable (installed, or with
``PYTHONPATH=python`` once the extension is built in place); when
``import gpipe`` fails, the repository's ``python/`` is tried. Both modes print
every warning and exit with status 1 when there is any, so undocumented API
cannot land quietly (tests/python/test_docs.py runs ``--check``).

What is documented:

* Python (python.md): every name in ``gpipe.__all__``, then every public
  submodule (``gpipe.balance``, ``gpipe.trace``, ...) with the names in its
  ``__all__``; for classes, the members they define themselves (methods,
  properties, ``#:``-commented attributes), pybind11 classes included
  (signatures from the first line of pybind11's docstrings, property types
  from their getters). Classes that public signatures return but that are
  only reachable through the private ``gpipe._C`` are documented too, under
  that name, and warned about.
* C++ (cpp.md): every public declaration of ``include/gpipe/*.h`` (namespace
  ``gpipe``, not ``detail``; public members): classes and structs, functions
  and member functions, data members, ``TORCH_ARG`` options,
  ``TORCH_MODULE`` holders, enums and each enumerator, with the ``///``
  comment right above it. A comment also covers the overloads of the same
  name that follow it directly.

Warnings: a public name without documentation (constructors, destructors,
``override``s of torch's virtuals and ``__init__``/``__repr__``/``__str__``/
``extra_repr`` are exempt: their class or base documents them); a reference
that does not resolve (a Sphinx role such as ``:class:`gpipe.X```, a C++
backticked ``Name::member`` whose first part is a gpipe name, a ``gpipe._C``
type in a public signature, a parameter missing from or unknown to an
``Args:`` section); a malformed comment (a ``///`` block not followed by a
declaration, an unclosed code fence, an unbalanced backtick, ``/** */`` or
``//!`` instead of ``///``); and, with ``--check``, output that differs from
what is committed.
"""
import argparse
import ast
import difflib
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
HEADERS = ROOT / "include" / "gpipe"
COMMAND = "python3 docs/api/build.py"


class Warnings:
    """Collects warnings, each once, in the order found."""

    def __init__(self) -> None:
        self.items: List[str] = []

    def __call__(self, where: str, message: str) -> None:
        text = f"{where}: {message}"
        if text not in self.items:
            self.items.append(text)


def anchor(name: str) -> str:
    """The HTML id of a documented name (letters, digits, '_' and '-' only)."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", name).strip("-")


# --------------------------------------------------------------------------
# Python
# --------------------------------------------------------------------------

#: Special methods documented (and required to have a docstring) when a class defines them.
PY_PROTOCOL = ("__call__", "__len__", "__iter__", "__getitem__", "__enter__", "__exit__")
#: Methods whose meaning their base class or class docstring gives.
PY_EXEMPT = ("__init__", "__repr__", "__str__", "extra_repr")

ROLE = re.compile(r":(class|func|meth|attr|mod|data|exc|obj):`(~?)([^`<>]+?)`")


def import_gpipe(warn: Warnings) -> Any:
    try:
        import gpipe  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
        try:
            import gpipe  # noqa: F401,F811
        except ImportError as e:
            raise SystemExit(f"build.py: cannot import gpipe ({e}); install it, or build the "
                             f"extension in place (see README) and set PYTHONPATH=python") from e
    import gpipe  # noqa: F811
    here = Path(gpipe.__file__).resolve().parent
    source = ROOT / "python" / "gpipe"
    if here != source.resolve():
        for own in sorted(source.glob("*.py")):
            other = here / own.name
            if not other.exists() or other.read_text() != own.read_text():
                warn(str(other), f"the imported gpipe ({here}) differs from the repository's "
                     f"python/gpipe/{own.name}: reinstall gpipe, or put python/ first on PYTHONPATH")
                break
    return gpipe


def is_pybind(obj: Any) -> bool:
    return type(obj).__name__ in ("pybind11_type", "builtin_function_or_method", "instancemethod") \
        or type(obj).__module__ == "pybind11_builtins"


def pybind_doc(obj: Any) -> Tuple[str, str]:
    """(signature line, docstring) of a pybind11 function: its __doc__ starts with the signature."""
    doc = obj.__doc__ or ""
    first, _, rest = doc.partition("\n")
    return first.strip(), inspect.cleandoc(rest) if rest.strip() else ""


def own_doc(obj: Any) -> str:
    """The object's own docstring (not one inherited from a base class, as inspect.getdoc would)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else ""


def annotation_text(node: ast.expr) -> str:
    """An annotation as written; a string annotation ("Pipe") without its quotes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def format_arguments(a: ast.arguments, drop_first: bool) -> str:
    """Parameters as PEP 8 writes them ("x: int = 1", "x=1"), from the AST."""
    def one(arg: ast.arg, default: Optional[ast.expr]) -> str:
        text = arg.arg
        if arg.annotation is not None:
            text += f": {annotation_text(arg.annotation)}"
            if default is not None:
                text += f" = {ast.unparse(default)}"
        elif default is not None:
            text += f"={ast.unparse(default)}"
        return text

    positional = list(a.posonlyargs) + list(a.args)
    defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    parts = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if not (drop_first and i == 0):
            parts.append(one(arg, default))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg is not None:
        parts.append("*" + one(a.vararg, None))
    elif a.kwonlyargs:
        parts.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(one(arg, default))
    if a.kwarg is not None:
        parts.append("**" + one(a.kwarg, None))
    return ", ".join(parts)


def source_signature(func: Callable[..., Any], name: str, drop_self: bool) -> Optional[str]:
    """The signature as written in the source (stable across Python versions, unlike reprs)."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name == inspect.unwrap(func).__name__:
            text = f"{name}({format_arguments(node.args, drop_self)})"
            if node.returns is not None:
                text += f" -> {annotation_text(node.returns)}"
            return text
    return None


def comment_docs(obj: Any) -> Dict[str, str]:
    """``#:`` comments above assignments and annotations in a class or module body."""
    try:
        lines, _ = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.ClassDef):
        body = body[0].body
    text = source.splitlines()
    docs: Dict[str, str] = {}
    for node in body:
        targets: List[ast.expr] = []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Assign):
            targets = list(node.targets)
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        comment: List[str] = []
        i = node.lineno - 2
        while i >= 0 and text[i].strip().startswith("#:"):
            comment.insert(0, text[i].strip()[2:].strip())
            i -= 1
        for n in names:
            if comment:
                docs[n] = " ".join(comment)
    return docs


@dataclass
class PyEntry:
    """One documented Python name."""

    name: str             # qualified, e.g. "gpipe.Pipe.forward"
    kind: str             # "module", "class", "function", "method", "property", "attribute", "alias"
    signature: str = ""
    doc: str = ""
    members: List["PyEntry"] = field(default_factory=list)
    note: str = ""        # e.g. "settable", "alias of ..."
    module: str = ""      # for resolving relative references
    owner: str = ""       # the class a member belongs to


class PythonApi:
    def __init__(self, gpipe: Any, warn: Warnings) -> None:
        self.gpipe = gpipe
        self.C = gpipe._C
        self.warn = warn
        self.names: Dict[str, PyEntry] = {}     # qualified name -> entry
        self.by_id: Dict[int, str] = {}         # id(object) -> first public name
        self.sections: List[Tuple[str, List[PyEntry]]] = []
        self.private_types: List[str] = []      # names in gpipe._C reached from public signatures

    # -- collecting --------------------------------------------------------

    def collect(self) -> None:
        gpipe = self.gpipe
        modules = [gpipe] + [importlib.import_module(f"gpipe.{m.name}")
                             for m in pkgutil.iter_modules(gpipe.__path__)
                             if not m.name.startswith("_")]
        # Public objects first get their names from gpipe.__all__, then from the submodules.
        for module in modules:
            for name in getattr(module, "__all__", []):
                obj = getattr(module, name, None)
                if obj is not None and not inspect.ismodule(obj):
                    self.by_id.setdefault(id(obj), f"{module.__name__}.{name}")
        for module in modules:
            entries = []
            doc = own_doc(module)
            if not doc:
                self.warn(module.__name__, "module has no docstring")
            head = PyEntry(module.__name__, "module", doc=doc, module=module.__name__)
            self.names[module.__name__] = head
            entries.append(head)
            if not hasattr(module, "__all__"):
                self.warn(module.__name__, "module has no __all__ saying what is public")
            comments = comment_docs(module)
            for name in getattr(module, "__all__", []):
                qual = f"{module.__name__}.{name}"
                if not hasattr(module, name):
                    self.warn(qual, "listed in __all__ but not defined")
                    continue
                entries.append(self.entry(qual, getattr(module, name), module.__name__,
                                          comments.get(name, "")))
            self.sections.append((module.__name__, entries))
        # Types public signatures reach only through gpipe._C, documented under that name.
        done: Set[str] = set()
        while True:
            todo = [n for n in self.private_types if n not in done]
            if not todo:
                break
            entries = []
            for name in todo:
                done.add(name)
                qual = f"gpipe._C.{name}"
                entries.append(self.entry(qual, getattr(self.C, name), "gpipe._C", ""))
            self.sections.append(("gpipe._C", entries))
        self.merge_private_sections()

    def merge_private_sections(self) -> None:
        private = [e for title, es in self.sections if title == "gpipe._C" for e in es]
        self.sections = [(t, es) for t, es in self.sections if t != "gpipe._C"]
        if private:
            self.sections.append(("gpipe._C", private))

    def entry(self, qual: str, obj: Any, module: str, comment: str) -> PyEntry:
        first = self.by_id.get(id(obj))
        if inspect.ismodule(obj):
            e = PyEntry(qual, "alias", module=module, note=f"the module [`{obj.__name__}`]"
                        f"(#{anchor(obj.__name__)}), documented below")
        elif first is not None and first != qual and first in self.names:
            e = PyEntry(qual, "alias", module=module, doc=comment,
                        note=f"the same object as [`{first}`](#{anchor(first)})")
        elif inspect.isclass(obj):
            e = self.klass(qual, obj, module)
        elif callable(obj):
            e = self.function(qual, obj, module, owner="")
        else:
            e = PyEntry(qual, "attribute", signature=f"{qual.rsplit('.', 1)[1]}: "
                        f"{type(obj).__name__}", doc=comment, module=module)
            if not comment:
                self.warn(qual, "no #: comment documents this attribute")
        self.names[qual] = e
        self.by_id.setdefault(id(obj), qual)
        return e

    def function(self, qual: str, obj: Any, module: str, owner: str,
                 bound: bool = True) -> PyEntry:
        short = qual.rsplit(".", 1)[1]
        method = bool(owner)
        if is_pybind(obj):
            sig, doc = pybind_doc(obj)
            sig = self.clean_pybind_signature(qual, sig, short)
        else:
            sig = source_signature(obj, short, drop_self=method and bound) or f"{short}{self.signature(obj)}"
            sig = self.publicise(qual, sig)
            doc = own_doc(obj)
            self.check_args(qual, obj, doc)
        if not doc:
            self.warn(qual, "no docstring")
        return PyEntry(qual, "method" if method else "function", signature=sig, doc=doc,
                       module=module, owner=owner)

    @staticmethod
    def signature(obj: Any) -> str:
        try:
            return str(inspect.signature(obj))
        except (TypeError, ValueError):
            return "(...)"

    def clean_pybind_signature(self, qual: str, sig: str, short: str) -> str:
        # "summary(self: gpipe._C.Trace) -> gpipe._C.TraceSummary" -> "summary() -> gpipe.Trace..."
        sig = re.sub(r"\((?:self|arg0): [\w.]+(?:, )?", "(", sig, count=1)
        if not sig.startswith(short):
            sig = short + sig
        return self.publicise(qual, sig)

    def publicise(self, qual: str, text: str) -> str:
        """Names types of gpipe._C by their public names; notes the private ones."""
        def public(match: "re.Match[str]") -> str:
            name = match.group(1)
            obj = getattr(self.C, name, None)
            if obj is None:
                self.warn(qual, f"refers to gpipe._C.{name}, which does not exist")
                return match.group(0)
            known = self.by_id.get(id(obj))
            if known is not None and not known.startswith("gpipe._C."):
                return known
            if name not in self.private_types:
                self.private_types.append(name)
            self.warn(qual, f"its signature refers to gpipe._C.{name}, which the public API does "
                      f"not export (add it to gpipe.__all__)")
            return f"gpipe._C.{name}"
        return re.sub(r"(?<![\w.])(?:gpipe\.)?_C\.(\w+)", public, text)

    def check_args(self, qual: str, obj: Any, doc: str) -> None:
        """An ``Args:`` section must name exactly the parameters."""
        items = section_items(doc, "Args")
        if items is None:
            return
        try:
            params = [p.name for p in inspect.signature(obj).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
        except (TypeError, ValueError):
            return
        for p in params:
            if p not in items:
                self.warn(qual, f"parameter {p!r} is missing from the Args section")
        for a in items:
            if a not in params:
                self.warn(qual, f"the Args section names {a!r}, which is not a parameter")

    def klass(self, qual: str, cls: type, module: str) -> PyEntry:
        short = qual.rsplit(".", 1)[1]
        doc = own_doc(cls)
        if not doc:
            self.warn(qual, "no docstring")
        init = vars(cls).get("__init__")
        if is_pybind(cls):
            sig = short + "()"
            if init is not None and is_pybind(init):
                s, _ = pybind_doc(init)
                sig = self.clean_pybind_signature(qual, s, "__init__").replace("__init__", short, 1)
                sig = re.sub(r" -> None$", "", sig)
            elif init is not None:
                sig = f"{short}  # not constructible from Python"
        else:
            init_fn = init if init is not None else getattr(cls, "__init__")
            sig = source_signature(init_fn, short, drop_self=True) or f"{short}{self.signature(cls)}"
            sig = re.sub(r" -> None$", "", self.publicise(qual, sig))
            if init is not None:
                self.check_args(qual, init, doc)
        e = PyEntry(qual, "class", signature=sig, doc=doc, module=module)
        self.names[qual] = e
        self.by_id.setdefault(id(cls), qual)
        comments = {} if is_pybind(cls) else comment_docs(cls)
        seen: Set[str] = set()
        for name, member in vars(cls).items():
            if name.startswith("_") and name not in PY_PROTOCOL:
                continue
            if name in PY_EXEMPT:
                continue
            mq = f"{qual}.{name}"
            if isinstance(member, property):
                e.members.append(self.prop(mq, member, module, qual))
            elif isinstance(member, (staticmethod, classmethod)):
                m = self.function(mq, member.__func__, module, owner=qual,
                                  bound=isinstance(member, classmethod))
                m.note = type(member).__name__
                e.members.append(m)
            elif callable(member):
                e.members.append(self.function(mq, member, module, owner=qual))
            elif name in getattr(cls, "__annotations__", {}) or name in comments:
                continue  # class-level values of annotated attributes: documented below
            else:
                continue
            self.names[mq] = e.members[-1]
            seen.add(name)
        for name, annotation in getattr(cls, "__annotations__", {}).items():
            if name.startswith("_") or name in seen:
                continue
            mq = f"{qual}.{name}"
            text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
            a = PyEntry(mq, "attribute", signature=f"{name}: {self.annotation_source(cls, name, text)}",
                        doc=comments.get(name, ""), module=module, owner=qual)
            if not a.doc:
                self.warn(mq, "no #: comment documents this attribute")
            e.members.append(a)
            self.names[mq] = a
        return e

    @staticmethod
    def annotation_source(cls: type, name: str, fallback: str) -> str:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            return fallback
        for node in tree.body[0].body if tree.body else []:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    node.target.id == name:
                return ast.unparse(node.annotation)
        return fallback

    def prop(self, qual: str, p: property, module: str, owner: str) -> PyEntry:
        short = qual.rsplit(".", 1)[1]
        doc = own_doc(p)
        if p.fget is not None and is_pybind(p.fget):
            first, _ = pybind_doc(p.fget)
            returns = first.split(" -> ", 1)[1] if " -> " in first else "..."
            sig = self.publicise(qual, f"{short}: {returns}")
        else:
            sig = short
            if p.fget is not None:
                s = source_signature(p.fget, short, drop_self=True)
                if s and " -> " in s:
                    sig = self.publicise(qual, f"{short}: {s.split(' -> ', 1)[1]}")
        if not doc:
            self.warn(qual, "no docstring")
        note = "property, settable" if p.fset is not None else "property, read-only"
        return PyEntry(qual, "property", signature=sig, doc=doc, note=note, module=module,
                       owner=owner)

    # -- rendering ----------------------------------------------------------

    def render(self) -> str:
        out = [
            "<!-- Generated by docs/api/build.py from the gpipe package's docstrings; do not edit."
            f" Regenerate: {COMMAND} -->",
            "# Python API reference",
            "",
            "Every public name of the `gpipe` package, from its docstrings (regenerate with",
            f"`{COMMAND}`; the C++ API is in [cpp.md](cpp.md)).",
            "",
        ]
        for title, entries in self.sections:
            if title == "gpipe._C":
                out += [f'<a id="{anchor(title)}"></a>', "", "## Reached through `gpipe._C`", "",
                        "Classes public signatures return that the package does not export yet;",
                        "their names may change.", ""]
            for e in entries:
                out += self.render_entry(e, level=2 if e.kind == "module" else 3)
        return tidy(out)

    def render_entry(self, e: PyEntry, level: int) -> List[str]:
        hashes = "#" * level
        label = {"module": "module", "class": "class", "function": "function", "method": "method",
                 "property": "property", "attribute": "attribute", "alias": "alias"}[e.kind]
        title = e.name.rsplit(".", 2)[-2] + "." + e.name.rsplit(".", 1)[1] if e.owner else e.name
        out = [f'<a id="{anchor(e.name)}"></a>', ""] if e.note[:10] != "the module" else []
        out += [f"{hashes} {label} `{title}`", ""]
        if e.note and e.kind == "alias":
            out += [f"{e.note[0].upper()}{e.note[1:]}.", ""]
        elif e.note:
            out += [f"*{e.note}*", ""]
        if e.signature:
            out += ["```python", e.signature, "```", ""]
        if e.doc:
            out += self.markdown(e.doc, e) + [""]
        for m in e.members:
            out += self.render_entry(m, level + 1)
        return out

    def resolve(self, target: str, e: PyEntry) -> Optional[str]:
        owner = e.owner or (e.name if e.kind == "class" else "")
        for candidate in (target, f"{owner}.{target}" if owner else "", f"{e.module}.{target}",
                          f"gpipe.{target}"):
            if candidate and candidate in self.names:
                return candidate
        return None

    def markdown(self, doc: str, e: PyEntry) -> List[str]:
        """A docstring (reST-flavoured, Google sections) as Markdown; checks its references."""
        if doc.count("``") % 2:
            self.warn(e.name, "unbalanced `` in the docstring")
        stripped = ROLE.sub("", doc.replace("``", ""))
        if re.search(r":(class|func|meth|attr|mod|data|exc|obj):", stripped):
            self.warn(e.name, "malformed reference (use :role:`target`)")

        def role(m: "re.Match[str]") -> str:
            target = m.group(3).strip()
            found = self.resolve(target, e)
            shown = target.rsplit(".", 1)[-1] if m.group(2) else target
            if found is not None:
                return f"[`{shown}`](#{anchor(found)})"
            if not target.startswith(("gpipe", "_")) and external(target):
                return f"`{shown}`"
            self.warn(e.name, f"unresolvable reference :{m.group(1)}:`{target}`")
            return f"`{shown}`"

        lines = doc.splitlines()
        out: List[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            section = re.match(r"^(Args|Arguments|Attributes|Returns|Raises|Yields|Note|Notes):\s*$", line)
            if line.rstrip().endswith("::"):
                head = line.rstrip()[:-2].rstrip()
                if head:
                    out.append(inline(head + ":", role))
                i += 1
                block: List[str] = []
                while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                    block.append(lines[i])
                    i += 1
                while block and not block[-1].strip():
                    block.pop()
                while block and not block[0].strip():
                    block.pop(0)
                out += ["", "```python"] + textwrap.dedent("\n".join(block)).splitlines() + ["```", ""]
                continue
            if section:
                out += [f"**{section.group(1)}:**", ""]
                i += 1
                item: List[str] = []
                while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                    text = lines[i]
                    if re.match(r"^ {4}\S", text):
                        if item:
                            out.append(inline(" ".join(item), role))
                        head, sep, rest = text.strip().partition(": ")
                        item = [f"- `{head}`: {rest}" if sep and " " not in head.split("(")[0]
                                else f"- {text.strip()}"]
                    elif text.strip():
                        item.append(text.strip())
                    i += 1
                if item:
                    out.append(inline(" ".join(item), role))
                out.append("")
                continue
            out.append(inline(line, role))
            i += 1
        return out


def tidy(lines: List[str]) -> str:
    """Joins lines, at most one blank line in a row, one newline at the end."""
    out: List[str] = []
    for line in lines:
        line = line.rstrip()
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"


def inline(text: str, role: Callable[["re.Match[str]"], str]) -> str:
    text = ROLE.sub(role, text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def external(target: str) -> bool:
    """Whether a dotted name outside gpipe resolves (torch.nn.Module, ...)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


def section_items(doc: str, section: str) -> Optional[List[str]]:
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"{section}:":
            items = []
            for text in lines[i + 1:]:
                if text.strip() and not text.startswith(" "):
                    break
                m = re.match(r"^ {4}(\w+)\s*(\([^)]*\))?:", text)
                if m:
                    items.append(m.group(1))
            return items
    return None


# --------------------------------------------------------------------------
# C++
# --------------------------------------------------------------------------

@dataclass
class CppEntry:
    name: str                 # qualified: "gpipe::PipeOptions::chunks"
    kind: str                 # class, struct, enum, enumerator, function, member, option, module
    decl: str
    doc: List[str]
    file: str
    line: int
    exempt: bool = False      # constructors, destructors, overrides
    overloads: List[str] = field(default_factory=list)


@dataclass
class Scope:
    kind: str                 # namespace, class, enum, body, init
    name: str
    access: str = "public"
    hidden: bool = False


class HeaderParser:
    """A line-oriented reader for gpipe's public headers (their house style, not all of C++)."""

    def __init__(self, path: Path, warn: Warnings) -> None:
        self.path = path
        self.rel = str(path.relative_to(ROOT))
        self.warn = warn
        self.entries: List[CppEntry] = []
        self.summary = ""
        self.includes: List[str] = []

    def where(self, line: int) -> str:
        return f"{self.rel}:{line}"

    def parse(self) -> None:
        lines = self.path.read_text().splitlines()
        scopes: List[Scope] = []
        doc: List[str] = []
        doc_line = 0
        stmt = ""
        stmt_line = 0
        body_depth = 0
        plain_comment = 0
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if body_depth > 0:
                body_depth += line.count("{") - line.count("}")
                continue
            if number == 1 and line.startswith("//"):
                self.summary = re.sub(r"^//\s*[\w.]+\s*[—-]+\s*", "", line)
                continue
            if line.startswith(("/**", "/*!", "//!")):
                self.warn(self.where(number), "use /// for documentation comments")
                continue
            if line.startswith("///"):
                if not doc:
                    doc_line = number
                doc.append(raw.strip()[3:][1:] if raw.strip()[3:4] == " " else raw.strip()[3:])
                continue
            if line.startswith("//"):
                plain_comment = number
                continue
            if not line:
                if doc and not stmt:
                    self.warn(self.where(doc_line), "/// comment not followed by a declaration "
                              "(a blank line separates them)")
                    doc = []
                plain_comment = 0
                continue
            if line.startswith("#"):
                m = re.match(r'#include <(gpipe/[\w.]+)>', line)
                if m:
                    self.includes.append(m.group(1))
                continue
            code = re.sub(r"\s*//.*$", "", line)
            if not stmt:
                stmt_line = number
                stmt_doc, stmt_doc_line = doc, doc_line
                doc = []
                if plain_comment and plain_comment == number - 1 and not stmt_doc and \
                        self.visible(scopes):
                    self.warn(self.where(plain_comment), "a // comment above a public "
                              "declaration: use /// if it documents it")
            stmt = (stmt + " " + code).strip()
            # Enumerators: one per line ("Always,") or all in "{ A, B }".
            if scopes and scopes[-1].kind == "enum":
                if stmt.startswith("}"):
                    scopes.pop()
                    stmt = ""
                    continue
                for name in [n.strip() for n in stmt.rstrip(",").split(",") if n.strip()]:
                    self.add(scopes, "enumerator", re.sub(r"\s*=.*$", "", name), name,
                             stmt_doc, stmt_line)
                    stmt_doc = []
                stmt = ""
                continue
            end = self.statement_end(stmt)
            if end is None:
                continue
            text, terminator, rest = stmt[:end].strip(), stmt[end], stmt[end + 1:]
            stmt = ""
            if terminator == ":":
                if scopes and scopes[-1].kind == "class":
                    scopes[-1].access = text
                continue
            if terminator == "}" or text.startswith("}"):
                if scopes:
                    scopes.pop()
                continue
            if terminator == "{":
                depth = 1 + rest.count("{") - rest.count("}")
                self.open(scopes, text, stmt_doc, stmt_line, depth, rest)
                if scopes and scopes[-1].kind == "body":
                    scopes.pop()
                    body_depth = depth
                continue
            self.declaration(scopes, text, stmt_doc, stmt_line)
        if doc:
            self.warn(self.where(doc_line), "/// comment at the end of the file documents nothing")

    @staticmethod
    def statement_end(stmt: str) -> Optional[int]:
        """Index of the ';', '{', '}' or access ':' that ends the statement at depth 0."""
        if stmt.startswith("}"):
            return 0
        if re.fullmatch(r"(public|private|protected)\s*:", stmt):
            return stmt.index(":")
        depth = 0
        for i, ch in enumerate(stmt):
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == "{":
                before = stmt[:i].rstrip()
                if depth == 0 and before and before[-1] not in "=,({":
                    return i
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == ";" and depth == 0:
                return i
        return None

    def visible(self, scopes: Sequence[Scope]) -> bool:
        return all(not s.hidden and (s.kind != "class" or s.access == "public") for s in scopes)

    def qualified(self, scopes: Sequence[Scope], name: str) -> str:
        return "::".join([s.name for s in scopes if s.kind in ("namespace", "class", "enum")] + [name])

    def add(self, scopes: Sequence[Scope], kind: str, name: str, decl: str, doc: List[str],
            line: int, exempt: bool = False) -> None:
        if not self.visible(scopes):
            return
        qual = self.qualified(scopes, name)
        previous = self.entries[-1] if self.entries else None
        if previous is not None and previous.name == qual and previous.kind == kind and \
                not doc and previous.line + len(previous.overloads) + 1 >= line - 1:
            previous.overloads.append(decl)  # an overload right after a documented one
            return
        self.entries.append(CppEntry(qual, kind, decl, doc, self.rel, line, exempt))

    def open(self, scopes: List[Scope], head: str, doc: List[str], line: int, depth: int,
             rest: str) -> None:
        m = re.match(r"^namespace\s*([\w:]*)$", head)
        if m:
            for part in (m.group(1) or "(anonymous)").split("::"):
                scopes.append(Scope("namespace", part,
                                    hidden=part in ("detail", "(anonymous)") or
                                    any(s.hidden for s in scopes)))
            return
        m = re.match(r"^(class|struct)\s+(\w+)(.*)$", head)
        if m:
            kind, name = m.group(1), m.group(2)
            self.add(scopes, kind, name, head, doc, line)
            scopes.append(Scope("class", name, access="public" if kind == "struct" else "private",
                                hidden=not self.visible(scopes)))
            return
        m = re.match(r"^enum\s+(class\s+|struct\s+)?(\w+)(.*)$", head)
        if m:
            name = m.group(2)
            self.add(scopes, "enum", name, head, doc, line)
            scope = Scope("enum", name, hidden=not self.visible(scopes))
            inner = rest.split("}")[0] if "}" in rest else rest
            if "}" in rest:  # one line: enum class X { A, B };
                scopes.append(scope)
                for n in [n.strip() for n in inner.split(",") if n.strip()]:
                    self.add(scopes, "enumerator", re.sub(r"\s*=.*$", "", n), n, [], line)
                scopes.pop()
            else:
                scopes.append(scope)
            return
        # A function defined in the header: its body is skipped.
        self.declaration(scopes, head, doc, line)
        scopes.append(Scope("body", ""))

    def declaration(self, scopes: Sequence[Scope], text: str, doc: List[str], line: int) -> None:
        text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", re.sub(r"\s+", " ", text)))
        if re.match(r"^(using|friend|typedef|static_assert)\b", text) or \
                re.match(r"^(class|struct|enum)\s+[\w:]+$", text):
            return  # using-declarations, forward declarations
        m = re.match(r"^TORCH_ARG\(\s*(.+),\s*(\w+)\s*\)", text)
        if m:
            self.add(scopes, "option", m.group(2), text + ";", doc, line)
            return
        m = re.match(r"^TORCH_MODULE\(\s*(\w+)\s*\)$", text)
        if m:
            self.add(scopes, "module", m.group(1), text + ";", doc, line)
            return
        head = re.sub(r"^template\s*<[^>]*>\s*", "", text)
        paren = head.find("(")
        eq = head.find("=")
        if paren >= 0 and (eq < 0 or paren < eq):
            m = re.search(r"(~?\w+|operator\s*\S+?)\s*$", head[:paren])
            name = m.group(1).replace(" ", "") if m else head[:paren]
            owner = scopes[-1].name if scopes and scopes[-1].kind == "class" else None
            exempt = name in (owner, f"~{owner}") or bool(re.search(r"\boverride\b", head)) or \
                bool(re.search(r"=\s*(delete|default)\s*$", head))
            kind = "method" if owner else "function"
            self.add(scopes, kind, name, text + ";", doc, line, exempt)
            return
        m = re.search(r"(\w+)\s*(=.*)?$", head)
        if m:
            kind = "member" if scopes and scopes[-1].kind == "class" else "variable"
            self.add(scopes, kind, m.group(1), text + ";", doc, line)


class CppApi:
    def __init__(self, warn: Warnings) -> None:
        self.warn = warn
        self.files: List[HeaderParser] = []
        self.names: Dict[str, CppEntry] = {}

    def collect(self) -> None:
        for path in sorted(HEADERS.glob("*.h")):
            p = HeaderParser(path, self.warn)
            p.parse()
            self.files.append(p)
            for e in p.entries:
                self.names.setdefault(e.name, e)
        umbrella = next((p for p in self.files if p.path.name == "gpipe.h"), None)
        if umbrella is not None:
            for p in self.files:
                header = f"gpipe/{p.path.name}"
                if p is not umbrella and header not in umbrella.includes:
                    self.warn(umbrella.rel, f"the umbrella header does not include <{header}>")
        for p in self.files:
            if not p.summary:
                self.warn(p.rel + ":1", "no first-line comment saying what the header is for")
            for e in p.entries:
                where = f"{e.file}:{e.line} {e.name}"
                if not e.doc and not e.exempt:
                    self.warn(where, f"no /// comment documents this {e.kind}")
                self.check_doc(e, where)

    def check_doc(self, e: CppEntry, where: str) -> None:
        fenced = False
        text: List[str] = []
        for line in e.doc:
            if line.strip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                text.append(line)
        if fenced:
            self.warn(where, "unclosed ``` code fence in its /// comment")
        joined = " ".join(text)
        if joined.count("`") % 2:
            self.warn(where, "unbalanced ` in its /// comment")
        for ref in re.findall(r"`([^`]+)`", joined):
            self.resolve(ref, e, where)

    def resolve(self, ref: str, e: CppEntry, where: str, warn: bool = True) -> Optional[str]:
        m = re.fullmatch(r"(?:gpipe::)?([A-Za-z_]\w*(?:::~?\w+)*)(?:\(\))?", ref.strip())
        if not m:
            return None
        path = m.group(1)
        first = path.split("::")[0]
        holder = self.names.get(f"gpipe::{first}")
        if holder is not None and holder.kind == "module" and "::" in path:
            path = first + "Impl" + path[len(first):]  # Pipe::forward is PipeImpl::forward
        scopes = e.name.split("::")
        # Relative to the entry's enclosing scopes, innermost first.
        for i in range(len(scopes), 0, -1):
            candidate = "::".join(scopes[:i] + [path])
            if candidate in self.names:
                return candidate
        if f"gpipe::{first}" in self.names and "::" in path:
            if warn:
                self.warn(where, f"unresolvable reference `{ref}`")
        return None

    def render(self) -> str:
        out = [
            "<!-- Generated by docs/api/build.py from include/gpipe/*.h; do not edit."
            f" Regenerate: {COMMAND} -->",
            "# C++ API reference",
            "",
            "Every public declaration of the headers in `include/gpipe/` (namespace `gpipe`), with",
            "its `///` comment. `#include <gpipe/gpipe.h>` brings the headers it lists; the Python",
            f"API is in [python.md](python.md). Regenerate with `{COMMAND}`.",
            "",
        ]
        for p in self.files:
            out += [f"## `<gpipe/{p.path.name}>`", "", p.summary, ""]
            if p.path.name == "gpipe.h":
                out += ["Includes " + ", ".join(f"`<{h}>`" for h in p.includes) + ".", ""]
            for e in p.entries:
                short = e.name[len("gpipe::"):] if e.name.startswith("gpipe::") else e.name
                level = "###" if e.name.count("::") <= 1 else "####"
                out += [f'<a id="{anchor(e.name)}"></a>', "", f"{level} {e.kind} `{short}`", "",
                        "```cpp", e.decl] + e.overloads + ["```", ""]
                if e.doc:
                    out += self.markdown(e) + [""]
        return tidy(out)

    def markdown(self, e: CppEntry) -> List[str]:
        out: List[str] = []
        fenced = False
        for line in e.doc:
            if line.strip().startswith("```"):
                out.append("```cpp" if not fenced and line.strip() == "```" else line.strip())
                fenced = not fenced
                continue
            if fenced:
                out.append(line)
                continue

            def link(m: "re.Match[str]") -> str:
                found = self.resolve(m.group(1), e, "", warn=False)
                return f"[`{m.group(1)}`](#{anchor(found)})" if found and found != e.name \
                    else m.group(0)
            out.append(re.sub(r"`([^`]+)`", link, line))
        return out


# --------------------------------------------------------------------------

def generate(warn: Warnings) -> Dict[Path, str]:
    gpipe = import_gpipe(warn)
    py = PythonApi(gpipe, warn)
    py.collect()
    python_md = py.render()
    cpp = CppApi(warn)
    cpp.collect()
    return {OUT / "python.md": python_md, OUT / "cpp.md": cpp.render()}


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api/python.md and cpp.md.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail when the committed files are stale or anything warns")
    args = parser.parse_args(argv)
    warn = Warnings()
    outputs = generate(warn)
    stale = []
    for path, text in outputs.items():
        old = path.read_text() if path.exists() else ""
        if old == text:
            continue
        if args.check:
            stale.append(path)
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), str(path) + " (committed)",
                                        str(path) + " (generated)", lineterm="", n=1)
            print("\n".join(list(diff)[:40]))
        else:
            path.write_text(text)
            print(f"wrote {shown(path)}")
    for w in warn.items:
        print(f"warning: {w}")
    for path in stale:
        print(f"error: {shown(path)} is stale; regenerate it with {COMMAND}")
    if warn.items:
        print(f"{len(warn.items)} warning(s): document what they name (docstrings, /// comments), "
              f"then run {COMMAND}")
    return 1 if warn.items or stale else 0


if __name__ == "__main__":
    sys.exit(main())
