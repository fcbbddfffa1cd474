"""Benchmark: `llmopt eval` (lm-eval's tasks on the llmopt engine) against lm-eval's own `hf` model at
batch size 8, same model, same task, one run. Prints both accuracies and the wall-time ratio of
lm-eval's `simple_evaluate` (model loading excluded on both sides, printed beside).

  python scripts/bench_eval_tasks.py                        # 300 questions, 4 choices, 0-shot
  python scripts/bench_eval_tasks.py --questions 100 --num-fewshot 2      # the same 2 examples first (MMLU's first_n)

The task is a local multiple-choice task written to a temporary folder from WikiText-2 (test): the
context is the first `--context-words` words of a paragraph, the right answer the next 12 words, the
three others 12-word spans of other paragraphs (HellaSwag's form on local data). lm-eval scores each
choice as one loglikelihood request, so the 4 requests of a question share its context: llmopt
submits all of them at once and reads each context from the prefix cache after its first choice;
`hf` runs them in batches of 8, each sequence whole.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchlib import hf_folder
from llmopt import defaults
from llmopt.eval.data import load_text_dataset
from llmopt.eval.tasks import task_manager

CHOICE_WORDS = 12


def write_task(folder: Path, n: int, context_words: int, seed: int, sampler: str) -> str:
    """The task YAML and its jsonl (see the module docstring); returns the task name."""
    text = load_text_dataset(defaults.PPL_DATASET).text
    paras = [line.split() for line in text.splitlines() if len(line.split()) >= context_words + CHOICE_WORDS]
    if len(paras) < n:
        raise SystemExit(f"WikiText-2 test has {len(paras)} paragraphs of {context_words + CHOICE_WORDS} words; "
                         f"ask for at most that many --questions")
    rng = random.Random(seed)
    picked = rng.sample(range(len(paras)), n)
    rows = []
    for i in picked:
        words = paras[i]
        others = rng.sample([j for j in range(len(paras)) if j != i], 3)
        wrong = []
        for j in others:
            start = rng.randrange(len(paras[j]) - CHOICE_WORDS + 1)
            wrong.append(" ".join(paras[j][start:start + CHOICE_WORDS]))
        answer = rng.randrange(4)
        choices = wrong[:answer] + [" ".join(words[context_words:context_words + CHOICE_WORDS])] + wrong[answer:]
        rows.append({"context": " ".join(words[:context_words]), "choices": choices, "answer": answer})
    data = folder / "wikitext_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "wikitext_mc.yaml").write_text(
        "task: wikitext_mc\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}\n"
        "test_split: test\nfewshot_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "target_delimiter: \" \"\nmetric_list: [{metric: acc}, {metric: acc_norm}]\n"
        f"fewshot_config: {{sampler: {sampler}}}\n")
    return "wikitext_mc"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in default model")
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--context-words", type=int, default=64)
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--fewshot-sampler", choices=("first_n", "default"), default="first_n",
                    help="first_n: the same examples before every question (MMLU's); default: random per question")
    ap.add_argument("--batch-size", type=int, default=8, help="the hf model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=("hf-first", "ours-first"), default="hf-first")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(Path(tmp), a.questions, a.context_words, a.seed, a.fewshot_sampler)
        manager = task_manager(tmp)               # lm-eval's TaskManager, offline
        # imported after task_manager, which sets the offline switches datasets reads at import
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from llmopt.eval.harness import LLMoptLM      # registers the `llmopt` lm-eval model
        folder = hf_folder(a.model, tmp)          # lm-eval's hf model reads a float folder (a GGUF's copy)

        def evaluate(make):
            t = time.perf_counter()
            lm = make()
            loaded = time.perf_counter() - t
            t = time.perf_counter()
            r = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, num_fewshot=a.num_fewshot,
                                        random_seed=a.seed, numpy_random_seed=a.seed, torch_random_seed=a.seed,
                                        fewshot_random_seed=a.seed, log_samples=False)
            return r["results"][task], loaded, time.perf_counter() - t

        runs = {"hf": lambda: HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=a.batch_size),
                "llmopt": lambda: LLMoptLM(model=a.model or defaults.DEFAULT_MODEL, dtype="float32")}
        order = ["hf", "llmopt"] if a.order == "hf-first" else ["llmopt", "hf"]
        got = {name: evaluate(runs[name]) for name in order}
    (hf_res, _, hf_s), (ours, _, our_s) = got["hf"], got["llmopt"]
    print(f"eval bench: {task}, {a.questions} questions x 4 choices, {a.num_fewshot}-shot ({a.fewshot_sampler}), "
          f"{torch.get_num_threads()} threads, model {a.model or defaults.DEFAULT_MODEL}")
    for name, (res, load, secs) in (("lm-eval hf (batch %d)" % a.batch_size, got["hf"]),
                                    ("llmopt eval", got["llmopt"])):
        print(f"  {name:22s}: acc {res['acc,none']:.4f}  acc_norm {res['acc_norm,none']:.4f}  "
              f"{secs:8.2f} s  (load {load:.1f} s)")
    same = ours["acc,none"] == hf_res["acc,none"] and ours["acc_norm,none"] == hf_res["acc_norm,none"]
    print(f"  same accuracies: {same};  speedup {hf_s / our_s:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
