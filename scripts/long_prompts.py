"""Write prompts/long.jsonl: chat prompts of 1-4k tokens (Qwen2.5's tokenizer) whose contexts are real documents
that ship with the packages speculant installs (package READMEs and the Apache 2.0 license): retrieval-augmented
questions and summaries, the long-context requests on which `auto` must not be slower than plain decoding.

    python scripts/long_prompts.py > prompts/long.jsonl

The file is in the repository, so a run does not depend on the installed versions; this script says where each
document came from."""

from __future__ import annotations

import argparse
import json
import re
from importlib.metadata import distribution

DOCUMENTS = {  # name: (distribution, file in its dist-info, where the text starts, characters kept)
    "h11": ("h11", "METADATA", "This is a little HTTP/1.1 library", 7000),
    "apache": ("requests", "licenses/LICENSE", "Apache License", 11000),
    "sortedcontainers": ("sortedcontainers", "METADATA", "`Sorted Containers`_ is an Apache2", 9000),
    "colorama": ("colorama", "METADATA", "Makes ANSI escape character sequences", 15000),
}

PROMPTS = [
    ("rag-long-1", "rag-long", "h11", "Using only the documentation above, explain what h11 does and does not do, "
     "and why a library might be designed that way."),
    ("rag-long-2", "rag-long", "apache", "Based on the license above, what must I do if I distribute a modified "
     "version of the software, and what happens to my patent license if I sue someone over the software?"),
    ("summarization-long-1", "summarization-long", "sortedcontainers", "Summarize the document above in a short "
     "paragraph for a developer deciding whether to use this library."),
    ("summarization-long-2", "summarization-long", "colorama", "Summarize the document above: what problem does "
     "the library solve, how is it used, and what are its limitations?"),
]


def document(name: str) -> str:
    package, file, start, keep = DOCUMENTS[name]
    text = distribution(package).read_text(file)
    text = text[text.index(start):]
    text = re.sub(r"\n\.\. (image|\|).*?(?=\n\S|\n\n)", "", text, flags=re.S)  # reStructuredText images
    return text[:keep].rsplit("\n\n", 1)[0].strip()


def main() -> None:
    for prompt_id, category, name, question in PROMPTS:
        content = f"{document(name)}\n\n{question}"
        print(json.dumps({"id": prompt_id, "category": category, "messages": [{"role": "user", "content": content}]}))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # (it takes no arguments)
    main()
