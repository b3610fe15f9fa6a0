"""The catalog of the kit's user-facing lines: key -> {"en": ..., "zh": ...}, str.format placeholders in both.

Read through kit.core.i18n's `t(key, **values)`. tests/test_i18n.py keeps it honest: every key in both languages
with the same placeholders, the Chinese really Chinese, and every key used somewhere in kit/. Technical terms (NPU,
TP, PP, LoRA, DeepSpeed, ZeRO, file names, flags, settings) stay as they are in both languages.
"""

from __future__ import annotations

from kit.errors import ERROR_PREFIX
from kit.storage.atomic import EXISTS

MESSAGES = {
    # the one-line error's prefix (the command line, the notebook): kit.errors owns it, being below this module
    "error.prefix": ERROR_PREFIX,
    # an output that exists, refused unless overwrite is asked: kit.storage.atomic owns it, for the same reason
    "output.exists": EXISTS,
    "language.unknown": {
        "en": "language {value!r} ({source}) is not one the kit speaks; use en or zh "
        "(KIT_LANG=zh, or `python -m kit project --language zh`).",
        "zh": "语言 {value!r}（来自 {source}）不受支持；请用 en 或 zh"
        "（KIT_LANG=zh，或 `python -m kit project --language zh`）。",
    },
    # the command line (kit/__main__.py)
    "cli.interrupted": {"en": "interrupted", "zh": "已中断"},
    "cli.unexpected": {
        "en": "unexpected {kind}: {first} — rerun with --debug (python -m kit --debug ...) for the traceback "
        "and report it.",
        "zh": "意外错误 {kind}：{first} —— 请加 --debug 重新运行（python -m kit --debug ...）查看 traceback，"
        "并报告这个问题。",
    },
    # the project settings (kit/core/project.py)
    "project.now": {
        "en": "Project: {origin}, language {language} ({language_from}); every notebook uses it unless its "
        "WORKSPACE or MODEL says otherwise ({path}).",
        "zh": "项目：{origin}，语言 {language}（{language_from}）；所有 notebook 都使用这些设置，"
        "除非其 WORKSPACE 或 MODEL 另行指定（{path}）。",
    },
    # the environment report (kit/doctor/report.py): column headers, verdicts, row labels, the summary sentence
    "doctor.col.status": {"en": "status", "zh": "状态"},
    "doctor.col.check": {"en": "check", "zh": "检查项"},
    "doctor.col.detail": {"en": "detail", "zh": "详情"},
    "doctor.col.fix": {"en": "fix", "zh": "修复方法"},
    "doctor.status.pass": {"en": "PASS", "zh": "通过"},
    "doctor.status.warn": {"en": "WARN", "zh": "警告"},
    "doctor.status.fail": {"en": "FAIL", "zh": "失败"},
    "doctor.status.info": {"en": "INFO", "zh": "提示"},
    "doctor.check.python": {"en": "python", "zh": "Python"},
    "doctor.check.torch": {"en": "torch", "zh": "torch"},
    "doctor.check.torch_npu": {"en": "torch_npu", "zh": "torch_npu"},
    "doctor.check.torch_pairing": {"en": "torch pairing", "zh": "torch 与 torch_npu 配套"},
    "doctor.check.cann": {"en": "CANN", "zh": "CANN"},
    "doctor.check.cann_env": {"en": "CANN env", "zh": "CANN 环境变量"},
    "doctor.check.cann_pairing": {"en": "CANN pairing", "zh": "CANN 与 torch_npu 配套"},
    "doctor.check.driver": {"en": "driver", "zh": "驱动"},
    "doctor.check.device": {"en": "device", "zh": "设备"},
    "doctor.check.dtype": {"en": "dtype", "zh": "数据类型（dtype）"},
    "doctor.check.visible_devices": {"en": "visible devices", "zh": "可见设备"},
    "doctor.check.deepspeed": {"en": "deepspeed", "zh": "DeepSpeed"},
    "doctor.check.task_queue": {"en": "task queue", "zh": "任务队列（TASK_QUEUE_ENABLE）"},
    "doctor.fix": {"en": "fix: {fix}", "zh": "修复方法：{fix}"},
    "doctor.summary.ok": {
        "en": "{total} checks: {passed} pass, {warned} warn, {failed} fail, {infos} info; nothing blocks the kit "
        "on {device} ({backend}).",
        "zh": "共 {total} 项检查：{passed} 项通过，{warned} 项警告，{failed} 项失败，{infos} 项提示；"
        "kit 可以在 {device}（{backend}）上运行。",
    },
    "doctor.summary.failed": {
        "en": "{total} checks: {passed} pass, {warned} warn, {failed} fail, {infos} info; fix the FAIL lines "
        "first (each says how), then run this check again.",
        "zh": "共 {total} 项检查：{passed} 项通过，{warned} 项警告，{failed} 项失败，{infos} 项提示；"
        "请先按各行的修复方法处理“失败”项，再重新运行本检查。",
    },
    "doctor.unknown_error": {
        "en": "not a known error; run `python -m kit doctor` and check each FAIL line",
        "zh": "不是已知错误；请运行 `python -m kit doctor`，逐条查看“失败”项",
    },
    "doctor.written": {"en": "report written to {path}", "zh": "报告已写入 {path}"},
    # the shared cell output (kit/core/show.py)
    "show.none": {"en": "(none)", "zh": "（无）"},
    # refusals a new user meets first
    "config.problems": {
        "en": "{count} problem(s) in {where}:",
        "zh": "{where} 中有 {count} 个问题：",
    },
    "workspace.bad_model_name": {
        "en": "model name {name!r} is not a plain folder name; use letters, digits, '.', '_' or '-' "
        "(for example 'Llama2-7B' or 'GLM3-6B').",
        "zh": "模型名 {name!r} 不是合法的文件夹名；只能使用字母、数字、'.'、'_' 或 '-'"
        "（例如 'Llama2-7B' 或 'GLM3-6B'）。",
    },
    "workspace.bad_run_type": {
        "en": "RUN_TYPE {run_type!r} is not one of {choices}.",
        "zh": "RUN_TYPE {run_type!r} 无效，可选值：{choices}。",
    },
    "manifest.want_kind": {"en": "a {kind} folder (made by {by})", "zh": "{kind} 文件夹（由 {by} 生成）"},
    "manifest.want_any": {"en": "a kit stage's output", "zh": "kit 某个阶段的输出文件夹"},
    "manifest.or": {"en": " or ", "zh": " 或 "},
    "manifest.absent": {
        "en": "{folder!r} does not exist; expected {want}.",
        "zh": "{folder!r} 不存在；这里需要 {want}。",
    },
    "manifest.is_file": {
        "en": "{folder!r} is a file; expected {want}.",
        "zh": "{folder!r} 是一个文件；这里需要 {want}。",
    },
    "manifest.none": {
        "en": "{folder!r} has no {manifest}, so the kit cannot tell what it holds; expected {want}.",
        "zh": "{folder!r} 中没有 {manifest}，kit 无法判断其中的内容；这里需要 {want}。",
    },
    "manifest.wrong_kind": {
        "en": "{folder!r} is a {kind} folder (made by {by}); expected {want}.",
        "zh": "{folder!r} 是 {kind} 文件夹（由 {by} 生成）；这里需要 {want}。",
    },
    "model.folder_absent": {
        "en": "model folder {folder!r} does not exist; give an HF or converted model folder.",
        "zh": "模型文件夹 {folder!r} 不存在；请指定 HF 模型文件夹或转换后的模型文件夹。",
    },
    "family.unknown": {
        "en": "unknown model family {name!r}; known: {known} or loader names {loaders}.",
        "zh": "未知的模型系列 {name!r}；已支持：{known}，或加载器名 {loaders}。",
    },
    "family.uncovered": {
        "en": "config.json has model_type {model_type!r}, which no family map covers; supported: {supported}. "
        "Pass family=... if it is a variant.",
        "zh": "config.json 中的 model_type {model_type!r} 没有对应的模型系列映射；已支持：{supported}。"
        "如果它是某个已支持系列的变体，请传入 family=...。",
    },
    "template.unknown": {
        "en": "template {template!r} is not one of {choices} or 'tokenizer'.",
        "zh": "模板 {template!r} 无效；可选：{choices} 或 'tokenizer'。",
    },
    "template.problem": {
        "en": "template={template!r}: use one of {choices}.",
        "zh": "template={template!r} 无效；可选：{choices}。",
    },
    # the planner's verdict (kit/plan/report.py) and the launch it refuses (kit/train/launch.py)
    "plan.what": {
        "en": "{params} parameters, sequence {seq_len}, MBS {mbs}, {dtype}",
        "zh": "{params} 参数，序列长度 {seq_len}，MBS {mbs}，{dtype}",
    },
    "plan.cards": {
        "en": "{cards} x {card} ({memory:g} GiB)",
        "zh": "{cards} 张 {card}（每张 {memory:g} GiB）",
    },
    "plan.fits": {
        "en": "{layout} fits on {cards}: {total} GiB per card for {what}{notes}.",
        "zh": "{layout} 在 {cards} 上放得下：{what}，每张卡 {total} GiB{notes}。",
    },
    "plan.does_not_fit": {
        "en": "{layout} does not fit on {cards}: {total} GiB per card for {what}; the largest term is {term} "
        "({size} GiB).{tail}",
        "zh": "{layout} 在 {cards} 上放不下：{what}，每张卡需要 {total} GiB；占用最大的一项是 {term}"
        "（{size} GiB）。{tail}",
    },
    "plan.fastest_fit": {
        "en": " The fastest plan that fits: {layout} ({total} GiB).",
        "zh": "能放下的最快方案：{layout}（{total} GiB）。",
    },
    "plan.some_fit": {
        "en": "{count} plans fit on {cards} for {what}; the fastest: {layout} ({total} GiB).",
        "zh": "{cards} 上有 {count} 个方案可以放下（{what}）；最快的是 {layout}（{total} GiB）。",
    },
    "plan.none_fit": {
        "en": "No plan fits on {cards} for {what}. The nearest: {layout} at {total} GiB per card, its largest "
        "term {term} ({size} GiB): more cards, a shorter sequence or LoRA.",
        "zh": "{cards} 上没有能放下的方案（{what}）。最接近的是 {layout}，每张卡 {total} GiB，占用最大的一项是 "
        "{term}（{size} GiB）：请增加卡数、缩短序列长度或改用 LoRA。",
    },
    "plan.will_it_fit": {"en": "Will it fit? {verdict}", "zh": "放得下吗？{verdict}"},
    "train.refused_does_not_fit": {
        "en": "{refusal} --force (force=True) launches it anyway.",
        "zh": "{refusal}如仍要启动，请加 --force（force=True）。",
    },
}
