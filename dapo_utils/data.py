"""The data a run reads: question/answer rows from any local data set `datasets` reads, their reference answers
in the format the user names (--answer_format), and the system prompt (text or @file).

    layout                                  how it is read
    a folder of parquet/JSON/JSONL/CSV      datasets.load_dataset(folder): splits from the file names (the seed's
                                            swulling/gsm8k_chinese is this: data/train-*.parquet, data/test-*)
    a save_to_disk folder                   datasets.load_from_disk (a Dataset is the "train" split)
    one .parquet/.json/.jsonl/.csv file     its rows are the "train" split
A data set without a "test" split holds a fixed random test_size rows of "train" out as "test".

    answer_format   the answer column holds        the reference answer the rewards see
    number          72, "72", "1,234", "3/4"       the value as it is (the seed's: a DataLoader makes an int a tensor)
    gsm8k           "...<<6*12=72>>72\\n#### 72"    the text after the last "####", commas removed: "72"
    latex           "\\frac{3}{4}", "2\\sqrt{3}"     the text, stripped (answer_checker='math_verify' compares it)
Rows with a null or empty question, or an answer that is null, NaN, empty or unreadable in the answer format, are
refused in one line naming the split, the column and the rows.
"""

import contextlib
import csv
import json
import math
import os

from torch.utils.data import Dataset

from dapo_utils.answers import normalize_answer, parse_number
from dapo_utils.notices import warn

QUESTION_COLUMN = "question_zh-cn"  # the seed's: swulling/gsm8k_chinese's Chinese problem text
ANSWER_COLUMN = "answer_only"  # the seed's: the final number, e.g. 72
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}  # one file's reader


class GSM8KDataset(Dataset):
    """Question/answer rows of a local data set (load_split: columns and rows checked): items {"prompt": question,
    "answer": the reference answer as answer_format reads it}. Without a "test" split, a fixed random `test_size`
    rows of "train" are held out. columns: (question column, answer column), the seed's by default."""

    def __init__(self, data_path, tokenizer, split="train", test_size=100, columns=None, answer_format="number"):
        self.tokenizer, self.answer_format = tokenizer, answer_format
        self.columns = tuple(columns or (QUESTION_COLUMN, ANSWER_COLUMN))
        self.data = load_split(data_path, split, test_size, self.columns, answer_format)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        sample, (question, answer) = self.data[index], self.columns
        return {"prompt": sample[question], "answer": read_answer(sample[answer], self.answer_format)}


def read_answer(value, answer_format):
    """The reference answer of one row as answer_format reads it (the module docstring's table); None when it
    cannot: null, NaN, empty, or (number, gsm8k) not a number."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or not str(value).strip():
        return None
    if answer_format == "latex":
        return str(value).strip()
    if answer_format == "gsm8k":
        text = str(value)
        value = text.rsplit("####", 1)[1].replace(",", "").strip() if "####" in text else None
    return value if value is not None and parse_number(normalize_answer(value)) is not None else None


def read_system_prompt(value):
    """The system prompt: the text itself, or "@path" for the text of that file."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ValueError(
            f"system_prompt {value!r}: cannot read {value[1:]!r} ({error.strerror}); give @FILE or the text"
        )


def load_split(data_path, split, test_size, columns, answer_format="number"):
    """One split of a local data set (the module docstring's layouts) with `columns` (question, answer), each row
    readable (bad_rows). Without a "test" split, a fixed random test_size rows of "train" are held out as "test"
    (test_size 0: none); the rows are checked before, so that row numbers are those of the file."""
    if not os.path.exists(data_path):
        raise FileNotFoundError(
            f"data set folder {data_path!r} does not exist. Download it with `hf download swulling/gsm8k_chinese "
            f"--repo-type dataset --local-dir {data_path}` (or from ModelScope), or set --data_path."
        )
    data = read_data_set(data_path, split)
    held_out = split in ("train", "test") and "test" not in data and "train" in data and test_size
    source = "train" if held_out else split
    if source not in data:
        raise ValueError(f"data set {data_path!r} has no split {split!r}; it has {sorted(data)}.")
    rows, found, where = data[source], data[source].column_names, f"split {source!r} of {data_path!r}"
    missing = [c for c in columns if c not in found]
    if missing:
        raise ValueError(
            f"{where} lacks the column(s) {missing} of swulling/gsm8k_chinese; it has {found}: "
            "name yours with --question_column and --answer_column"
        )
    if len(rows) == 0:
        raise ValueError(f"{where} is empty; GSM8KDataset needs question/answer rows")
    problems = bad_rows(rows[columns[0]], rows[columns[1]], columns, answer_format)
    if problems:
        raise ValueError(f"{where} {problems}")
    if held_out and len(rows) <= test_size:
        raise ValueError(
            f"{where} has {len(rows)} rows and the data set no test split: holding out test_size={test_size} rows "
            "as the test split would leave none to train on; give it a test split (a folder holding train.jsonl "
            "and test.jsonl, or train-*.parquet and test-*.parquet), or hold out fewer rows with --test_size=N"
        )
    return rows.train_test_split(test_size=test_size, seed=0)[split] if held_out else rows


def read_data_set(data_path, split):
    """{split: rows} of a folder or file (the module docstring's layouts). A JSON-lines or CSV file with a line
    that does not read is named with the line (malformed_line)."""
    import datasets  # here, not at the top: train.py loads without it (gpu_check.sh's parts keep rows in memory)

    if os.path.isfile(data_path):
        builder = FILE_BUILDERS.get(os.path.splitext(data_path)[1].lower())
        if builder is None:
            raise ValueError(f"cannot read {data_path!r}: give a {'/'.join(FILE_BUILDERS)} file or a folder")
        try:
            return datasets.load_dataset(builder, data_files={"train": data_path})
        except Exception as error:  # datasets wraps pyarrow's and pandas' errors, which name no file
            raise ValueError(unreadable([data_path], error)) from error
    if any(os.path.exists(os.path.join(data_path, n)) for n in ("dataset_dict.json", "state.json")):  # save_to_disk
        data = datasets.load_from_disk(data_path)
        return {"train": data} if isinstance(data, datasets.Dataset) else data
    try:
        return datasets.load_dataset(data_path)
    except Exception as error:  # datasets wraps Arrow's errors: an empty parquet file, splits of other types
        return load_splits_apart(data_path, split, error)


def bad_rows(questions, answers, columns, answer_format):
    """'' when every row has a question and an answer that answer_format reads; else what is wrong, in words: the
    column and the first rows (numbered from 0, as in the file), with the fix."""
    no_question = [i for i, q in enumerate(questions) if q is None or not str(q).strip()]
    unread = [i for i, a in enumerate(answers) if read_answer(a, answer_format) is None]
    no_answer = [i for i in unread if read_answer(answers[i], "latex") is None]  # null, NaN or empty
    unreadable = sorted(set(unread) - set(no_answer))
    missing = [
        f"has no {column} in rows {rows[:10]}" for column, rows in zip(columns, (no_question, no_answer)) if rows
    ]
    problems = ["; ".join(missing) + ": fill or drop them"] if missing else []
    if unreadable:
        problems.append(
            f"has answers in {columns[1]} that --answer_format={answer_format} cannot read in rows {unreadable[:10]} "
            f"({', '.join(repr(answers[i]) for i in unreadable[:3])}): fix them or choose another --answer_format "
            "(number; gsm8k: the number after '####'; latex)"
        )
    return "; ".join(problems)


def load_splits_apart(data_path, split, error):
    """The data set's splits read one by one, for splits whose columns differ (datasets reads a folder's
    splits under one schema): a warning names the columns in which `split` differs from "train". A split that
    does not read by itself either gets the one line of an empty or damaged file."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(data_path)
        files = builder.config.data_files
        data = {name: datasets.load_dataset(builder.name, data_files={name: files[name]}, split=name) for name in files}
    except Exception:  # noqa: BLE001 - the first error is the one to report
        files = [os.path.join(folder, name) for folder, _, names in os.walk(data_path) for name in sorted(names)]
        raise ValueError(unreadable(files, error, data_path)) from error
    if split in data and split != "train" and "train" in data:
        differ = column_differences(data[split].features, data["train"].features)
        warn(f"split {split!r} of {data_path!r} differs from 'train': {differ} (each split is read on its own)")
    return data


def column_differences(features, train_features):
    """'answer_only is string there, int64 in train; source is only there': how a split's columns differ."""
    differ = [
        f"{c} is {t.dtype} there, {train_features[c].dtype} in train"
        for c, t in features.items()
        if c in train_features and t != train_features[c]
    ]
    differ += [f"{c} is only there" for c in features if c not in train_features]
    return "; ".join(differ + [f"{c} is only in train" for c in train_features if c not in features])


def unreadable(files, error, data_path=None):
    """The line for a data set that does not read: the first of its JSON-lines or CSV files with a line that does
    not (malformed_line), else the reader's own words."""
    for path in files:
        line = malformed_line(path)
        if line:
            return f"cannot read {path}: {line}: fix or remove that line"
    where = f"the data set in {data_path!r}" if data_path else repr(files[0])
    cause = str(error.__cause__ or error).strip().splitlines()[0]
    return f"cannot read {where}: {cause} (an empty or damaged file?)"


def malformed_line(path):
    """'' when each line of a JSON-lines (.jsonl, or .json that is not one JSON value) or CSV file reads, else the
    first one that does not, in words: `line 3 (numbered from 1, as in an editor) is not a JSON object (...)`,
    `line 4 has 3 fields, the header 2`. Other files: ''."""
    kind = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        if kind == ".csv":
            rows = [(i, row) for i, row in enumerate(csv.reader(f), 1) if row]
            width = len(rows[0][1]) if rows else 0
            bad = next(((i, len(row)) for i, row in rows if len(row) != width), None)
            return f"line {bad[0]} has {bad[1]} fields, the header {width}" if bad else ""
        if kind not in (".json", ".jsonl"):
            return ""
        text = f.read()
    if kind == ".json":
        with contextlib.suppress(ValueError):
            json.loads(text)
            return ""  # one JSON value (a list of rows): datasets' error is about its content, not a line
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number} is not a JSON object ({error.msg}, at column {error.colno})"
            if not isinstance(row, dict):
                return f"line {number} is not a JSON object ({type(row).__name__})"
    return ""
