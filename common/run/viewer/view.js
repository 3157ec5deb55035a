// The SEAL run viewer: data/run.js (loaded by index.html) and one data file per round and per
// evaluation, loaded when opened (common/run/view.py writes them). Every view is a URL fragment:
//   #run                              the rounds, evaluations and OOD scores
//   #round/T?label=&cat=&reward=&mixed=1&sort=&desc=1     a round's trajectories
//   #traj/T/TASK/SAMPLE               one trajectory
//   #task/TASK                        a task's samples across rounds
//   #eval/TAG?cat=&valid=&with=RUN    an evaluation's tasks
//   #evaltraj/TAG/TASK?with=RUN       one evaluated task, beside another run's play of it
// Every text from the artifacts goes into the page as text (h() below), never as markup.
"use strict";

const RUN = window.SEAL_LOADED;
const loaded = {};
let queue = Promise.resolve();

// A data file is a script assigning SEAL_LOADED; loads run one at a time so each reads its own.
function load(src) {
  queue = queue.then(() => src in loaded ? loaded[src] : new Promise((resolve) => {
    window.SEAL_LOADED = undefined;
    const s = document.createElement("script");
    const done = (value) => { loaded[src] = value; s.remove(); resolve(value); };
    s.onload = () => done(window.SEAL_LOADED || null);
    s.onerror = () => done(null);
    s.src = src;
    document.head.appendChild(s);
  }));
  return queue;
}

// a trajectory train_grpo.py --cut mask left out (its round's train_metrics.jsonl cut_stops)
const CUT_NOTE = "not the policy's failure under evaluation's rules: left out of the loss and of its group's mean and std";

function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids.flat(Infinity)) {
    if (k != null && k !== false) e.append(k instanceof Node ? k : String(k));
  }
  return e;
}

const pad = (t) => String(t).padStart(3, "0");
const fmt = (v, d = 3) => (typeof v === "number" ? v.toFixed(d) : "–");
const link = (href, ...kids) => h("a", { href }, ...kids);
const enc = encodeURIComponent;
const trajHref = (t, id, s) => `#traj/${t}/${enc(id)}/${s}`;
const labelChip = (z) => h("span", { class: `label ${z}` }, z);
const table = (head, rows, attrs) => h("table", attrs || {}, h("thead", {}, h("tr", {}, head)), h("tbody", {}, rows));
const num = (v, d) => h("td", { class: "num" }, typeof v === "number" && d != null ? fmt(v, d) : v ?? "–");

function missingBox(items, what) {
  if (!items || !items.length) return null;
  return h("div", { class: "missing" }, h("b", {}, `${what}: what is missing or cut`),
    h("ul", {}, items.map((m) => h("li", {}, m))));
}

function route() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  return { parts: path.split("/").filter((p) => p !== "").map(decodeURIComponent), params: new URLSearchParams(query || "") };
}

function setParams(view, params) {
  const q = [...params].filter(([, v]) => v !== "" && v != null);
  location.hash = view + (q.length ? "?" + new URLSearchParams(q) : "");
}

function cues(omega) {
  if (!omega) return "–";
  const on = [];
  if (omega.schema_cue && omega.schema_cue.enabled) on.push("schema");
  if (omega.error_feedback) on.push("error");
  for (const c of omega.capability_cues || []) on.push(`cap:${c.label}`);
  return on.join(", ") || "none";
}

// ---------------------------------------------------------------------------------- the run

function viewRun() {
  const s = RUN.settings || {};
  const labels = RUN.labels;
  const turned = !!s.turn_credit;  // seal-turn: the turn weights' figures of the round's steps
  const rounds = table(
    [...["round", "trajectories", "reward", "w, all", "opt. steps (global)", "Ω cues", "model tokens"].map((x) => h("th", {}, x)),
      turned ? [h("th", { title: "mean weight of the turns holding model tokens (train metrics)" }, "turn w"),
        h("th", { title: "of the model tokens with A < 0, those in turns verified right (weight 0)" }, "A<0 tokens zeroed")] : null,
      ...labels.map((z) => h("th", { class: "share", title: `share of turns labelled ${z}` }, z.replace(/_/g, " ")))],
    RUN.rounds.map((r) => h("tr", {},
      h("td", {}, link(`#round/${r.round}`, `round ${r.round}`)), num(r.trajectories), num(r.reward, 3),
      num(r.w_mean, 3), h("td", {}, `${r.steps} (${r.global_step ?? "–"})`), h("td", {}, cues(r.omega)),
      num(r.gen_tokens), turned ? [num(r.turn_w_mean, 3), num(r.turn_zeroed_share, 3)] : null,
      labels.map((z) => num(r.label_share[z], 2)))), { id: "rounds" });
  // the ρ each round's weights used: its interface's table, or (seal-adaptive) the round's own ρ_t
  const adaptive = !!s.adaptive_rho;
  const rhoNote = (r) => (r.rho_adapted === false ? " (kept)" : adaptive && r.rho_adapted == null ? " (table: not trained yet)" : "");
  const rho = table(["round", ...labels.map((z) => z.replace(/_/g, " "))].map((x) => h("th", {}, x)),
    RUN.rounds.map((r) => h("tr", {}, h("td", {}, `round ${r.round}${rhoNote(r)}`),
      labels.map((z) => num(r.rho ? r.rho[z] : null, 3)))), { id: "rho" });
  const cats = RUN.categories;
  const evals = table(["evaluation", ...cats, "average"].map((x) => h("th", {}, x)),
    RUN.evals.map((e) => h("tr", {}, h("td", {}, link(`#eval/${e.tag}`, e.tag)),
      [...cats, "average"].map((c) => num(e.scores && e.scores[c], 2)))), { id: "evals" });
  const ood = RUN.ood.length ? [h("h2", {}, "Out of distribution"), table(["policy", "bench", "scores"].map((x) => h("th", {}, x)),
    RUN.ood.flatMap((o) => Object.entries(o.benches).map(([b, sc]) => h("tr", {}, h("td", {}, o.tag), h("td", {}, b),
      h("td", {}, Object.entries(sc).filter(([, v]) => typeof v === "number").map(([k, v]) => `${k} ${fmt(v, 2)}`).join(" · "))))))] : [];
  return [
    h("h1", {}, `Run ${RUN.name}`),
    h("p", {}, `preset ${s.preset ?? "?"}, mode ${s.mode ?? "?"}, model ${s.model ?? "?"}, commit ${(RUN.git_commit || "?").slice(0, 10)}`),
    missingBox(RUN.missing, "This run"),
    h("h2", {}, "Rounds"), RUN.rounds.length ? rounds : h("p", {}, "No round has rollouts yet."),
    h("h2", {}, "ρ per label (the utilities of the weight w)"),
    s.reweight === "--no-reweight" ? h("p", {}, `Mode ${s.mode} trains with w = 1: ρ is not used.`)
      : [adaptive ? h("p", {}, "Each round's own ρ, from its diagnoses by the mixed-group rule (docs/design.md §6).") : null,
        RUN.rounds.length ? rho : h("p", {}, "No round yet.")],
    h("h2", {}, "Held-in evaluations (%)"), RUN.evals.length ? evals : h("p", {}, "No evaluation yet."),
    ood,
    RUN.siblings.length ? [h("h2", {}, "Other runs beside this one"),
      h("p", {}, RUN.siblings.map((n) => [link(`../../${enc(n)}/viewer/index.html`, n), " "]))] : null,
  ];
}

// ---------------------------------------------------------------------------------- a round

const mixedTasks = (rows) => {
  const by = {};
  for (const r of rows) if (r.diagnosis) (by[r.task_id] ||= new Set()).add(r.diagnosis.reward);
  return new Set(Object.keys(by).filter((k) => by[k].size > 1));
};

const SORTS = {
  task: (r) => `${r.task_id}\u0000${String(r.sample_index).padStart(6, "0")}`,
  reward: (r) => r.diagnosis?.reward ?? -1,
  A: (r) => r.A ?? 0,
  w: (r) => r.w ?? 0,
  wa: (r) => (r.w ?? 0) * (r.A ?? 0),
  abs_wa: (r) => Math.abs((r.w ?? 0) * (r.A ?? 0)),
  gen: (r) => r.tokens?.trained ?? 0,
};

function select(name, value, options, onchange) {
  return h("label", {}, `${name} `, h("select", { name, onchange },
    options.map(([v, text]) => h("option", { value: v, selected: String(v) === String(value) ? "selected" : null }, text))));
}

async function viewRound(t, params) {
  const data = await load(`data/round_${pad(t)}.js`);
  if (!data) return [h("h1", {}, `Round ${t}`), h("p", { class: "missing" }, `No data for round ${t} (data/round_${pad(t)}.js).`)];
  const all = data.rows;
  const mixed = mixedTasks(all);
  const p = (k) => params.get(k) || "";
  const change = (k) => (ev) => {
    params.set(k, ev.target.type === "checkbox" ? (ev.target.checked ? "1" : "") : ev.target.value);
    setParams(`round/${t}`, params);
  };
  let rows = all.filter((r) =>
    (!p("label") || (r.diagnosis?.turn_labels || []).includes(p("label"))) &&
    (!p("cat") || r.category === p("cat")) &&
    (!p("reward") || String(r.diagnosis?.reward) === p("reward")) &&
    (!p("mixed") || mixed.has(r.task_id)));
  const sort = SORTS[p("sort")] ? p("sort") : "task";
  const desc = p("desc") === "1" || (!params.has("desc") && sort === "abs_wa");
  rows = rows.map((r) => [SORTS[sort](r), r]).sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0) * (desc ? -1 : 1)).map((x) => x[1]);
  const head = (text, key) => h("th", key ? { class: "sortable", title: "sort", onclick: () => {
    params.set("desc", sort === key && !desc ? "1" : "0"); params.set("sort", key); setParams(`round/${t}`, params);
  } } : {}, text, key === sort ? (desc ? " ▼" : " ▲") : "");
  return [
    h("h1", {}, `Round ${t}`, h("span", { class: "muted" }, ` · Ω ${cues(data.omega)}`)),
    missingBox(data.missing, `Round ${t}`),
    h("div", { class: "filters" },
      select("label", p("label"), [["", "any label"], ...RUN.labels.map((z) => [z, z])], change("label")),
      select("cat", p("cat"), [["", "any category"], ...RUN.categories.map((c) => [c, c])], change("cat")),
      select("reward", p("reward"), [["", "any reward"], ["1", "1"], ["0", "0"]], change("reward")),
      h("label", {}, h("input", { type: "checkbox", name: "mixed", checked: p("mixed") ? "checked" : null, onchange: change("mixed") }),
        " mixed groups only"),
      select("sort", sort, [["task", "task, sample"], ["abs_wa", "largest |w·A|"], ["wa", "w·A"], ["A", "A"], ["w", "w"],
        ["reward", "reward"], ["gen", "model tokens"]], change("sort")),
      h("span", { id: "count" }, `${rows.length} of ${all.length} trajectories`)),
    table([head("task", "task"), head("sample"), head("category"), head("reward", "reward"), head("A", "A"), head("w", "w"),
      head("w·A", "wa"), head("turn labels"), head("stop"), head("model tokens", "gen"), head("prompt + ids"), head("")],
    rows.map((r) => h("tr", { class: "traj" },
      h("td", {}, link(`#task/${enc(r.task_id)}`, r.task_id)), num(r.sample_index), h("td", {}, r.category),
      num(r.diagnosis?.reward), num(r.A, 3), num(r.w, 3), num(r.A != null ? r.w * r.A : null, 3),
      h("td", {}, (r.diagnosis?.turn_labels || []).map(labelChip)),
      h("td", {}, r.stop ?? "–", r.cut ? h("span", { class: "cut", title: CUT_NOTE }, " cut") : null),
      num(r.tokens?.trained), h("td", { class: "num" }, r.tokens ? `${r.tokens.prompt} + ${r.tokens.ids}` : "–"),
      h("td", {}, link(trajHref(t, r.task_id, r.sample_index), "open")))), { id: "trajectories" }),
  ];
}

// ---------------------------------------------------------------------------------- a trajectory

const canon = (v) => JSON.stringify(v, (k, x) => (x && typeof x === "object" && !Array.isArray(x)
  ? Object.fromEntries(Object.keys(x).sort().map((key) => [key, x[key]])) : x));

// Ground-truth calls matched to the model's: same name and arguments first, then same name.
function matchCalls(gt, model) {
  const used = new Set();
  const marks = { gt: [], model: model.map(() => ({ kind: "extra", keys: [] })) };
  for (const g of gt) {
    let i = model.findIndex((m, j) => !used.has(j) && m.name === g.name && canon(m.arguments) === canon(g.arguments));
    if (i < 0) i = model.findIndex((m, j) => !used.has(j) && m.name === g.name);
    if (i < 0) { marks.gt.push({ kind: "missing-call", keys: [] }); continue; }
    used.add(i);
    const a = g.arguments || {}, b = model[i].arguments || {};
    const keys = [...new Set([...Object.keys(a), ...Object.keys(b)])].filter((k) => canon(a[k]) !== canon(b[k]));
    marks.gt.push(marks.model[i] = { kind: keys.length ? "differs" : "same", keys });
  }
  return marks;
}

function callText(call, keys) {
  const args = Object.entries(call.arguments || {});
  return h("span", { class: "call" }, call.name, "(",
    args.map(([k, v], i) => [i ? ", " : "", h("span", { class: keys && keys.includes(k) ? "argdiff" : null }, `${k}=${JSON.stringify(v)}`)]),
    ")");
}

function callList(calls, marks, empty) {
  if (!calls.length) return h("p", { class: "muted" }, empty);
  return h("ul", {}, calls.map((c, i) => h("li", { class: marks[i].kind }, callText(c, marks[i].keys),
    h("span", { class: "muted" }, ` ${{ "same": "✓", "differs": "≠ arguments", "missing-call": "missing", "extra": "not in ground truth" }[marks[i].kind]}`))));
}

function omegaBox(omega) {
  if (!omega) return h("div", { class: "box cue" }, "Ω: none (plain prompts, as in evaluation)");
  const sc = omega.schema_cue || {};
  return h("div", { class: "cue" }, h("b", {}, `Ω version ${omega.version ?? "?"} `),
    h("div", {}, "schema cue: ", sc.enabled ? ["on (", ["required", "types", "enums"].filter((k) => sc[k]).join(", "), ")"] : "off"),
    h("div", {}, "error feedback: ", omega.error_feedback ? "on" : "off"),
    h("div", {}, "capability cues (system prompt): ", (omega.capability_cues || []).length ? "" : "none"),
    h("ul", {}, (omega.capability_cues || []).map((c) => h("li", {}, labelChip(c.label), " ", c.text))));
}

const RUN_KIND = ["context", "model", "re-rendered prompt"];

function tokenStrip(tok, steps, rerendered) {
  if (!tok) return null;
  const total = tok.runs.reduce((a, r) => a + r[1], 0) || 1;
  const trainedRuns = tok.runs.filter((r) => r[0] === 1).length;
  const starts = tok.rerendered_at || [];
  return h("div", { class: "box" }, h("b", {}, "Tokens "),
    `prompt ${tok.prompt}, then ${tok.ids} ids of which ${tok.trained} are the model's (mask 1, trained); `,
    rerendered ? "evaluation re-renders every prompt from the history, as bfcl-eval's harness does: the ids are the model's outputs only."
      : trainedRuns === steps ? `the k-th blue run is step k's output.` : `${trainedRuns} model runs for ${steps} steps.`,
    starts.length ? ` The prompt was re-rendered (reasoning dropped, as bfcl-eval's handler does) at turn${starts.length > 1 ? "s" : ""} `
      + `${starts.join(", ")}: each segment from there (orange, its new prompt) is trained as a sequence of its own.` : "",
    h("div", { class: "strip", title: "blue: model tokens (trained); grey: prompt continuation, cues, tool results; orange: a re-rendered prompt" },
      tok.runs.map(([m, n]) => h("span", { class: `m${m}`, style: `flex: ${n / total} 0 0`, title: `${RUN_KIND[m]} ${n}` }))));
}

function stepBox(step, j, trainedTokens) {
  const n = (step.calls || []).length;
  return h("div", { class: "step" },
    h("div", { class: "muted" }, `step ${j + 1}`, trainedTokens != null ? ` · ${trainedTokens} model tokens` : ""),
    h("pre", { class: "text" }, step.text ?? ""),
    step.parse_error ? h("div", { class: "bad" }, "parse error: ", step.parse_error) : null,
    n ? table(["decoded call", "result", "error", "schema error"].map((x) => h("th", {}, x)),
      step.calls.map((c, i) => h("tr", {}, h("td", {}, callText(c)), h("td", {}, h("pre", {}, String(step.results?.[i] ?? ""))),
        h("td", { class: "bad" }, step.call_errors?.[i] ?? ""), h("td", { class: "bad" }, step.schema_errors?.[i] ?? "")))) : null,
    step.feedback ? h("div", { class: "box cue" }, h("b", {}, "error feedback Ω added: "), h("pre", {}, step.feedback)) : null);
}

// One play of a task: its turns and steps beside the task's user turns and ground truth.
function trajectoryView(row, task, extra) {
  const diag = row.diagnosis || {};
  const verdict = row.verdict || diag.official || null;
  const turns = row.turns || [];
  const nTurns = Math.max(turns.length, (diag.turn_labels || []).length, task ? task.questions.length : 0);
  const runs = (row.tokens?.runs || []).filter((r) => r[0] === 1).map((r) => r[1]);
  const nSteps = turns.reduce((a, t) => a + (t.steps || []).length, 0);
  let stepNo = 0;
  const out = [
    table([], [
      ["task", [link(`#task/${enc(row.task_id)}`, row.task_id), ` (${row.category ?? "?"}), sample ${row.sample_index ?? 0}`]],
      ["reward", diag.reward ?? (verdict ? (verdict.valid ? 1 : 0) : "–")],
      ...(extra || []),
      ["official verdict", verdict ? (verdict.valid ? h("span", { class: "ok" }, "valid")
        : h("span", { class: "bad" }, verdict.reward_breakdown  // τ²-bench: its evaluator's checks, one per episode
          ? `invalid: ${Object.entries(verdict.reward_breakdown).map(([k, v]) => `${k} ${v}`).join(", ") || verdict.note || "?"} (${verdict.termination})`
          : `invalid: ${verdict.error_type ?? "?"} at turn ${verdict.turn ?? "?"}`)) : "not diagnosed yet"],
      ["turn labels", (diag.turn_labels || []).map(labelChip)],
      ["stop", [row.stop ?? "–", row.stop === "context_limit" ? " (the prompt was cut at the context limit)" : "",
        row.inference_error ? ` · inference error: ${row.inference_error}` : "",
        row.cut ? h("span", { class: "cut" }, ` · cut: ${CUT_NOTE}`) : null]],
      ["decode failure rule", row.decode_failure ?? "–"],
      ["policy", row.policy ?? "–"],
    ].map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", { class: k.replace(/\W/g, "_") }, v))), { class: "kv" }),
    tokenStrip(row.tokens, nSteps, row.interface_version == null && row.verdict),
  ];
  for (let k = 0; k < nTurns; k++) {
    const turn = turns[k];
    const label = (diag.turn_labels || [])[k];
    // seal-turn: the weight this turn's model tokens train with (its trained advantage is A times it)
    const tw = row.turn_w ? row.turn_w[k] : null;
    out.push(h("h2", {}, `Turn ${k} `, label ? labelChip(label) : null,
      tw != null ? h("span", { class: "turnw", title: "turn weight: this turn's model tokens train with A × this" },
        ` weight ${fmt(tw)}${row.A < 0 && tw === 0 ? " (verified right: not penalised)" : ""}`) : null));
    if (diag.evidence && diag.evidence[k]) out.push(h("div", { class: "evidence" }, "evidence: ", diag.evidence[k]));
    // τ²-bench: the user simulator's message that opened the turn is in the record
    const msgs = task ? task.questions[k] || [] : turn && turn.user ? [{ role: "user", content: turn.user }] : [];
    for (const m of msgs) out.push(h("div", { class: "box user" }, h("b", {}, `${m.role}: `), h("pre", {}, m.content)));
    if (task && !msgs.length) out.push(h("p", { class: "muted" }, "no user message this turn: the withheld functions are listed now"));
    if (!turn) { out.push(h("p", { class: "muted" }, "not played: the trajectory stopped before this turn")); continue; }
    (turn.steps || []).forEach((s, j) => out.push(stepBox(s, j, row.interface_version == null && row.verdict ? null : runs[stepNo++])));
    out.push(h("p", { class: "muted" }, `turn ended: ${turn.end}`, turn.end === "context_limit" ? " (the prompt was cut here)" : ""));
    const model = (turn.steps || []).flatMap((s) => s.calls || []);
    const gt = task && task.gt_calls ? task.gt_calls[k] || [] : null;
    if (gt) {
      const marks = matchCalls(gt, model);
      out.push(h("div", { class: "gt" },
        h("div", {}, h("h3", {}, "ground truth"), callList(gt, marks.gt, "no calls (abstain)")),
        h("div", {}, h("h3", {}, "model"), callList(model, marks.model, "no calls"))));
    } else if (task) {
      out.push(h("div", {}, h("h3", {}, "ground truth"), h("pre", {}, (task.ground_truth[k] || []).join("\n"))));
    }
  }
  return out;
}

async function viewTraj(t, id, s) {
  const data = await load(`data/round_${pad(t)}.js`);
  const row = data && data.rows.find((r) => r.task_id === id && String(r.sample_index) === String(s));
  if (!row) return [h("h1", {}, "Trajectory"), h("p", { class: "missing" }, `Round ${t} has no trajectory ${id} sample ${s}.`)];
  const same = data.rows.filter((r) => r.task_id === id);
  return [
    h("h1", {}, `Round ${t} · ${id} · sample ${s}`),
    h("p", {}, link(`#round/${t}`, `← round ${t}`), " · samples of this task: ",
      same.map((r) => [link(trajHref(t, id, r.sample_index), `${r.sample_index}`),
        ` (${r.diagnosis?.reward ?? "?"}) `])),
    missingBox(data.missing, `Round ${t}`),
    trajectoryView(row, data.tasks[id], [["A (group advantage)", fmt(row.A)], ["w (diagnosis weight)", fmt(row.w)],
      row.turn_w ? ["A × turn weight (trained advantage, per turn)", row.turn_w.map((v, k) => `turn ${k}: ${fmt(v * row.A)}`).join(" · ")]
        : ["w·A (trained advantage)", row.A != null ? fmt(row.w * row.A) : "–"], ["Ω shown", omegaBox(data.omega)]]),
  ];
}

// ---------------------------------------------------------------------------------- a task across rounds

function viewTask(id) {
  const rows = RUN.rounds.map((r) => [r, r.samples.filter((x) => x[0] === id)]).filter(([, xs]) => xs.length);
  return [
    h("h1", {}, `Task ${id}`),
    rows.length ? table(["round", "samples: reward and turn labels", "mean reward"].map((x) => h("th", {}, x)),
      rows.map(([r, xs]) => h("tr", {}, h("td", {}, link(`#round/${r.round}`, `round ${r.round}`)),
        h("td", {}, xs.map(([, s, reward, labels]) => h("div", {}, link(trajHref(r.round, id, s), `sample ${s}`),
          `: ${reward} `, (labels || []).map(labelChip)))),
        num(xs.reduce((a, x) => a + (x[2] || 0), 0) / xs.length, 2))), { id: "task-rounds" })
      : h("p", {}, "No training round played this task."),
    h("p", {}, "In the evaluations: ", RUN.evals.map((e) => [link(`#evaltraj/${e.tag}/${enc(id)}`, e.tag), " "])),
  ];
}

// ---------------------------------------------------------------------------------- evaluations

async function viewEval(tag, params) {
  const ev = RUN.evals.find((e) => e.tag === tag);
  const data = ev && await load(`data/${ev.data}.js`);
  if (!data) return [h("h1", {}, `Evaluation ${tag}`), h("p", { class: "missing" }, `No data for evaluation ${tag}.`)];
  const p = (k) => params.get(k) || "";
  const change = (k) => (e) => { params.set(k, e.target.value); setParams(`eval/${tag}`, params); };
  const rows = data.rows.filter((r) => (!p("cat") || r.category === p("cat")) &&
    (!p("valid") || String(!!r.verdict?.valid) === p("valid")));
  const q = p("with") ? `?with=${enc(p("with"))}` : "";
  return [
    h("h1", {}, `Evaluation ${tag}`, h("span", { class: "muted" }, " · held-in, greedy, Ω removed")),
    missingBox(data.missing, `Evaluation ${tag}`),
    h("div", { class: "filters" },
      select("cat", p("cat"), [["", "any category"], ...RUN.categories.map((c) => [c, c])], change("cat")),
      select("valid", p("valid"), [["", "any verdict"], ["true", "valid"], ["false", "invalid"]], change("valid")),
      RUN.siblings.length ? select("with", p("with"), [["", "no other run"], ...RUN.siblings.map((n) => [n, `beside ${n}`])], change("with")) : null,
      h("span", { id: "count" }, `${rows.length} of ${data.rows.length} tasks`)),
    table(["task", "category", "verdict", "error type", "turn", "stop", "model tokens"].map((x) => h("th", {}, x)),
      rows.map((r) => h("tr", { class: "traj" }, h("td", {}, link(`#evaltraj/${tag}/${enc(r.task_id)}${q}`, r.task_id)),
        h("td", {}, r.category), h("td", { class: r.verdict?.valid ? "ok" : "bad" }, r.verdict ? (r.verdict.valid ? "valid" : "invalid") : "not scored"),
        h("td", {}, r.verdict?.error_type ?? ""), num(r.verdict?.turn), h("td", {}, r.stop ?? "–"), num(r.tokens?.trained))),
      { id: "trajectories" }),
  ];
}

async function otherRun(name, tag, id) {
  if (!RUN.siblings.includes(name)) return [h("p", { class: "missing" }, `${name}: not a run beside this one.`)];
  const base = `../../${enc(name)}/viewer/`;
  const other = await load(`${base}data/run.js`);
  if (!other) return [h("p", { class: "missing" }, `${name} has no viewer (python -m common.run.view runs/${name}).`)];
  const ev = other.evals.find((e) => e.tag === tag) || other.evals[other.evals.length - 1];
  const data = ev && await load(`${base}data/${ev.data}.js`);
  const row = data && data.rows.find((r) => r.task_id === id);
  if (!row) return [h("p", { class: "missing" }, `${name} has no evaluated play of ${id}.`)];
  return [h("h2", {}, `${name} · ${ev.tag}`), trajectoryView(row, data.tasks[id])];
}

async function viewEvalTraj(tag, id, params) {
  const ev = RUN.evals.find((e) => e.tag === tag);
  const data = ev && await load(`data/${ev.data}.js`);
  const row = data && data.rows.find((r) => r.task_id === id);
  const mine = row ? trajectoryView(row, data.tasks[id]) : [h("p", { class: "missing" }, `Evaluation ${tag} has no play of ${id}.`)];
  const other = params.get("with");
  return [
    h("h1", {}, `Evaluation ${tag} · ${id}`),
    h("p", {}, link(`#eval/${tag}`, `← evaluation ${tag}`), " · this task in: ",
      RUN.evals.map((e) => [link(`#evaltraj/${e.tag}/${enc(id)}${other ? "?with=" + enc(other) : ""}`, e.tag), " "]),
      RUN.siblings.length ? [" · beside: ", RUN.siblings.map((n) => [link(`#evaltraj/${tag}/${enc(id)}?with=${enc(n)}`, n), " "])] : null),
    other ? h("div", { class: "pair" }, h("div", {}, h("h2", {}, `${RUN.name} · ${tag}`), mine), h("div", {}, await otherRun(other, tag, id)))
      : mine,
  ];
}

// ---------------------------------------------------------------------------------- the page

function nav() {
  return [link("#run", `run ${RUN.name}`), " rounds: ", RUN.rounds.map((r) => link(`#round/${r.round}`, String(r.round))),
    " evaluations: ", RUN.evals.map((e) => link(`#eval/${e.tag}`, e.tag))];
}

async function render() {
  const main = document.getElementById("main");
  if (!RUN) { main.replaceChildren(h("p", { class: "missing" }, "data/run.js did not load: rebuild with python -m common.run.view runs/NAME")); return; }
  const { parts, params } = route();
  const [view, a, b, c] = parts;
  const newest = RUN.rounds.length ? RUN.rounds[RUN.rounds.length - 1].round : null;
  let body;
  if (view === "round" && a != null) body = await viewRound(a, params);
  else if (view === "traj") body = await viewTraj(a, b, c);
  else if (view === "task") body = viewTask(a);
  else if (view === "eval") body = await viewEval(a, params);
  else if (view === "evaltraj") body = await viewEvalTraj(a, b, params);
  else if (view === "run" || newest == null) body = viewRun();
  else body = await viewRound(newest, params);
  document.getElementById("nav").replaceChildren(h("span", {}, nav()));
  main.replaceChildren(h("div", { id: "view", "data-view": view || "round" }, body));
  document.title = `SEAL ${RUN.name} ${location.hash}`;
  document.body.setAttribute("data-ready", location.hash || "#");
  document.body.setAttribute("data-ms", Math.round(performance.now()));  // since navigation: bench/view_bench.py
}

window.addEventListener("hashchange", render);
render();
