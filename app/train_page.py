"""Train page: a small training run of a chosen family and task, live and stoppable.

A run belongs to one session at a time: only that session sees and can stop it. When its page is
closed or reloaded, a run still going (or one that failed, with its error) is offered on every open
Train page, and the first session to take it becomes its one owner (`orphaned`, `adopt`): after a
reload the user finds their run again. Names are one path component (letters, digits, '.', '_', '-',
starting with a letter or digit) under MEMVIZ_HOME, and a name another session's run is using is
refused, so no two runs share folders."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import streamlit as st
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from app.model_page import score_rows
from memviz import viz
from memviz.checkpoint import USER_DIR
from training import QUICK_LENGTHS, TrainConfig, Trainer, parse_curriculum, quick_config, quick_families, quick_lr

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = ("tr_family", "tr_task", "tr_steps", "tr_curriculum")
#: and those keyed by family or task (the learning rate, the sequence length)
KEPT_PREFIXES = ("tr_lr_", "tr_length_")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: a run's name is a folder name: the export writes `.NAME.writing-PID-...` beside it, in a name's 255 bytes
MAX_NAME = 200


@st.cache_resource
def names_in_use() -> dict:
    """Every session's runs on this server: name -> job (so two sessions never write one folder)."""
    return {}


def jobs() -> dict:
    """This session's training jobs, surviving reruns: name -> {trainer, thread, status}."""
    return st.session_state.setdefault("_train_jobs", {})


def session_id() -> str:
    """This browser session's id ("" outside a running script)."""
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else ""


def session_open(sid: str) -> bool:
    """Whether the session `sid` still has a page connected; True where no Streamlit server runs (bare mode),
    so a run is never handed to another session there."""
    return not Runtime.exists() or bool(Runtime.instance().is_active_session(sid))


#: held while a session checks a run's owner and takes it, so two sessions never both take one run
OWNERSHIP = threading.Lock()


def orphaned() -> list[dict]:
    """Runs of other sessions whose page was closed or reloaded: still going, or failed with an error no one saw."""
    me = session_id()
    return [
        job
        for job in list(names_in_use().values())
        if job["owner"] != me and job["status"] in ("running", "exporting", "failed") and not session_open(job["owner"])
    ]


def adopt(job: dict) -> bool:
    """Make this session the run's one owner, if its owner's page is still gone; whether it did."""
    with OWNERSHIP:
        if session_open(job["owner"]):
            return False
        job["owner"] = session_id()
        jobs()[job["name"]] = job
        return True


def run_job(job: dict) -> None:
    try:
        job["trainer"].run()
        job["status"] = "exporting"
        job["exported"] = str(
            job["trainer"].export(USER_DIR / job["name"], final_eval=not job["trainer"].stop.is_set())
        )
        job["status"] = "stopped" if job["trainer"].stop.is_set() else "finished"
    except Exception as exc:  # shown on the page; the last checkpoint stays on disk
        job["status"], job["error"] = "failed", str(exc)


@st.fragment(run_every=2.0)
def live(name: str) -> None:
    job = jobs().get(name)
    if job is None or job["owner"] != session_id():  # taken by another page while this one was away
        st.info(f"Run **{name}** is watched from another page now.")
        return
    trainer = job["trainer"]
    st.plotly_chart(viz.training_loss(trainer.out / "metrics.jsonl"), width="stretch", key=f"loss-{name}")
    st.write(f"**{name}**: {job['status']} · step {trainer.step} / {trainer.cfg.optim.steps}")
    if job["status"] == "running" and st.button("Stop (saves a checkpoint)", key=f"stop-{name}"):
        trainer.stop.set()
    if job.get("exported"):
        scores = ", ".join(
            f"{row['probe']} {row['score']}" for row in score_rows(trainer.model.card.get("probe_scores") or {})
        )
        st.success(
            f"Saved {job['exported']}; it is listed on the Model page."
            + (f" Probe scores: {scores}." if scores else "")
        )
    if job.get("error"):
        st.error(f"Training failed: {job['error']}")


def start(name: str, cfg: TrainConfig) -> None:
    """Start this session's run `name` in a thread; one message if its folder holds an earlier run."""
    try:
        trainer = Trainer(cfg, progress=False)
    except ValueError as exc:
        st.error(f"{exc}. Choose another name.")
        return
    job: dict[str, Any] = {"name": name, "status": "running", "trainer": trainer, "owner": session_id()}
    job["thread"] = threading.Thread(target=run_job, args=(job,), daemon=True)
    jobs()[name] = names_in_use()[name] = job
    job["thread"].start()


def runs_dir() -> Path:
    """Where the app's runs keep their checkpoints and metrics (beside the exported checkpoints)."""
    return USER_DIR.parent / "runs"


def fresh_name(family: str, task: str) -> str:
    """`family-task-N` with the first N that no run and no checkpoint uses yet."""
    taken = set(names_in_use())
    n = 1
    while (name := f"{family}-{task}-{n}") in taken or (USER_DIR / name).exists() or (runs_dir() / name).exists():
        n += 1
    return name


def render() -> None:
    st.title("Train")
    c1, c2, c3 = st.columns(3)
    family: str = c1.selectbox("Family", sorted(quick_families()), key="tr_family")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
    task: str = c2.selectbox("Task", sorted(QUICK_LENGTHS), key="tr_task")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
    steps = c3.number_input("Steps", 1, 100_000, 300, key="tr_steps")
    c4, c5 = st.columns(2)
    lr = c4.number_input("Learning rate", 1e-5, 1e-1, quick_lr(family), format="%.4g", key=f"tr_lr_{family}")
    length = c5.number_input(
        "Sequence length (tokens)", 64, 4096, QUICK_LENGTHS[task], step=64, key=f"tr_length_{task}"
    )
    curriculum_text = st.text_input(
        "Curriculum (optional; replaces the length): step:length stages, the sequences growing at those steps",
        key="tr_curriculum",
        placeholder="0:256, 150:1024",
    )
    started = st.session_state.pop("_tr_started", None)
    if (
        "tr_name" not in st.session_state
        or st.session_state["tr_name"] == started
        or st.session_state.get("_tr_default") != (family, task)
    ):  # a fresh name for each choice, and after a run starts unless another was typed since
        st.session_state["tr_name"] = fresh_name(family, task)
        st.session_state["_tr_default"] = (family, task)
    name = st.text_input("Name (a new folder under runs/ and the checkpoints)", key="tr_name")
    if st.button("Start", key="tr_start"):
        busy = names_in_use().get(name)
        if not name.strip():
            st.error("Give the run a name.")
        elif name != name.strip():
            st.error(f"The name {name!r} begins or ends with a space; take it out.")
        elif not NAME.fullmatch(name):
            st.error("The name may hold letters, digits, '.', '_' and '-' only, and starts with a letter or digit.")
        elif len(name) > MAX_NAME:
            st.error(
                f"The name has {len(name)} characters; at most {MAX_NAME} (a folder name, with room for its files)."
            )
        elif busy is not None and busy["status"] in ("running", "exporting"):
            st.error(f"A run named {name!r} is still going.")
        elif (USER_DIR / name).exists() or (runs_dir() / name).exists():
            st.error(f"{name!r} is an earlier run's folder; choose a new name.")
        else:
            try:
                curriculum = parse_curriculum(curriculum_text) if curriculum_text.strip() else None
            except ValueError as exc:
                st.error(str(exc))
            else:
                start(
                    name,
                    quick_config(
                        family,
                        task,
                        int(steps),
                        name,
                        runs_dir() / name,
                        lr=float(lr),
                        length=int(length),
                        curriculum=curriculum,
                    ),
                )
                st.session_state["_tr_started"] = name
    for job in orphaned():
        left = job["trainer"]
        st.info(
            f"Run **{job['name']}** ({job['status']}, step {left.step} / {left.cfg.optim.steps}) was started from a "
            "page that has since been closed or reloaded."
        )
        if st.button(f"Take over {job['name']} here", key=f"adopt-{job['name']}") and adopt(job):
            st.rerun()
    for name, job in list(jobs().items()):
        if job["owner"] == session_id():  # a run another page took over is no longer this one's
            live(name)
        else:
            del jobs()[name]
