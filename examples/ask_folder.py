"""Stores the .txt and .md files of a folder in a diffragd collection, then asks a question
over it, printing the answer as it is generated and the sources it rests on.

The collection is COLLECTION, or "examples" when none is named. The daemon creates it on the
first ingest if it does not exist; a later run replaces the same documents (the id is the
file's name). `diffrag drop examples` removes it.

    pip install clients/python
    python3 examples/ask_folder.py tcp://127.0.0.1:7400 examples "How long is the Rhine?" [COLLECTION]
"""
import pathlib
import sys

import diffrag


def main(endpoint: str, folder: str, question: str, collection: str = "examples") -> int:
    files = sorted(p for p in pathlib.Path(folder).iterdir() if p.suffix in (".txt", ".md"))
    docs = [{"id": p.name, "title": p.stem, "text": p.read_text()} for p in files]
    with diffrag.Client(endpoint) as client:
        stored = client.ingest(collection, [d for d in docs if d["text"]])
        print(f'stored {stored.ingested} documents in the collection "{collection}" (created if '
              f'it was not there); it holds {stored.docs} documents, {stored.chunks} chunks')
        try:
            for item in client.stream(question, collection=collection, max_tokens=64):
                if isinstance(item, diffrag.Delta):
                    print(item.text, end="", flush=True)
                else:
                    answer = item
        except diffrag.DiffragError as e:
            print(f"\nquery failed: {e} (code {e.code})", file=sys.stderr)
            return 1
    print("\n\nsources:")
    for c in answer.citations:
        print(f"  [{c.marker}] {c.doc_id} (score {c.score:.2f})")
    print(f"{answer.usage.completion_tokens} tokens generated in {answer.timings.total_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit("usage: ask_folder.py ENDPOINT FOLDER QUESTION [COLLECTION]")
    sys.exit(main(*sys.argv[1:]))
