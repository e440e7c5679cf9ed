#!/bin/sh
# `make run`: answers a sample question over a sample paragraph with the default model through
# the command line, on the embedded defaults.
set -eu
cd "$(dirname "$0")/.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
PARAGRAPH=$(cat examples/sample-paragraph.txt)
QUESTION="How long is the Rhine?"
echo "document: examples/sample-paragraph.txt"
echo "question: $QUESTION"
printf 'answer: '
exec build/diffrag-run -m "$MODEL" --chat -n 64 \
    -p "Answer the question using only this document.

Document:
$PARAGRAPH

Question: $QUESTION"
