"""docs/options.md, generated from the options table (``_options.OPTIONS``)
and the entries of ``run()``'s docstring.

    python -m remote_tpu._options_doc            # writes docs/options.md
    python -m remote_tpu._options_doc --check    # exit status 1 if it is stale

tests/unit/test_options.py fails when the page is not what this writes.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from ._options import DOC_PAGE, OPTIONS, Option

HEADER = ("<!-- generated from remote_tpu/_options.py by python -m remote_tpu._options_doc: "
          "do not edit -->")
_ENTRY = re.compile(r"^    (\w+): ", re.MULTILINE)


def docstring_entries(doc: str) -> dict[str, str]:
    """``name: text`` entries of a docstring (each at the first indent, its
    text running on, indented deeper), in order, their text on one line."""
    starts = list(_ENTRY.finditer(doc))
    out = {}
    for here, after in zip(starts, starts[1:] + [None]):
        body = doc[here.end():after.start() if after else len(doc)]
        body = body.split("\n\n", 1)[0]          # up to the next paragraph
        out[here.group(1)] = " ".join(line.strip() for line in body.splitlines()).strip()
    return out


def _markdown(text: str) -> str:
    return text.replace("``", "`")


def _default(option: Option) -> str:
    shown = f"`{option.default!r}`"
    return f"{shown}: {option.means}" if option.means else shown


def _flag(option: Option) -> str:
    flag = option.flag
    if flag is None:
        return ""
    if flag.switch is not None:
        return f"`{option.cli}`"
    metavar = flag.metavar or "{" + ",".join(flag.choices) + "}"
    return f"`{option.cli} {metavar}`" + (" (repeatable)" if flag.many else "")


def _spec(option: Option) -> str:
    if option.spec is None:
        return ""
    fields = ", ".join(f"`{f}`" for f in option.spec.fields)
    return f"{fields} (set by {option.spec.by})" if option.spec.by else fields


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def generate() -> str:
    from ._decorator import run

    details = docstring_entries(run.__doc__ or "")
    missing = [o.name for o in OPTIONS if o.name not in details]
    if missing:
        raise SystemExit(f"run()'s docstring has no entry for {', '.join(missing)}")
    lines = [
        HEADER,
        "# Options of `remote_tpu.run()`",
        "",
        "Every option of `@remote_tpu.run(...)`, in the order of its signature. An argument "
        "given wins over its environment variable, which wins over the default. "
        "`remote-tpu run SCRIPT` takes the options that have a flag; the others are for "
        "functions only, or are set through their variables.",
        "",
        "| option | default | variable | `remote-tpu run` | what it is |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in OPTIONS:
        variables = ", ".join(f"`{v}`" for v in o.variables)
        lines.append(f"| [`{o.name}`](#{o.name}) | {_cell(_default(o))} | "
                     f"{_cell(variables)} | {_cell(_flag(o))} | {_cell(o.help)} |")
    for o in OPTIONS:
        lines += ["", f"## {o.name}", "", f"`{o.name}: {o.type} = {o.default!r}`", "",
                  _markdown(details[o.name]), ""]
        facts = [("default", _default(o)),
                 ("environment", ", ".join(f"`{v}`" for v in o.variables)),
                 ("`remote-tpu run`", _flag(o)),
                 ("job spec", _spec(o) or "none (it stays on the client)")]
        lines += [f"- {label}: {value}" for label, value in facts if value]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote_tpu._options_doc",
                                description="write docs/options.md from the options table")
    p.add_argument("--output", default=str(pathlib.Path(__file__).resolve().parent.parent /
                                           DOC_PAGE),
                   help="the page to write (default: this checkout's %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit with 1 if the page is not what it would write")
    args = p.parse_args(argv)
    page = pathlib.Path(args.output)
    text = generate()
    if args.check:
        fresh = page.is_file() and page.read_text(encoding="utf-8") == text
        if not fresh:
            print(f"{page} is stale: run python -m remote_tpu._options_doc", file=sys.stderr)
        return 0 if fresh else 1
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
