/* Cockpit's GPUs page: every token, who holds it and since when, what was stopped
 * for it, what is stranded or poisoned and how to fix it, and the history as a
 * timeline.  Everything comes from charly-arbiter's --json outputs (arbiter.js);
 * the page stays current through one `status --json --follow` process, which
 * prints a line only when the ledger, the history or the state changed. */

import { ArbiterFailure, followStatus, loadConfig, runJson } from "./arbiter.js";
import { buildTimeline, drawTimeline } from "./timeline.js";

const state = {
    status: null,
    failure: null,
    history: null, // null until the first `history --json` answers
    historyFailure: null,
    subject: "",
    claimants: new Set(),
    admin: null,
    notice: null,
};

let stopFollowing = null;
let retryTimer = null;

/* -- small DOM helpers: text always goes in as text, never as markup -------------- */

function h(tag, attributes, ...children) {
    const element = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) {
        if (value === null || value === undefined || value === false)
            continue;
        if (key.startsWith("on"))
            element.addEventListener(key.slice(2), value);
        else if (key === "class")
            element.className = value;
        else
            element.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
        if (child === null || child === undefined || child === false)
            continue;
        element.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return element;
}

function $(id) {
    return document.getElementById(id);
}

function safeId(text) {
    return text.replace(/[^A-Za-z0-9_-]/g, "_");
}

/* Re-rendering replaces elements; a keyboard user keeps the focus on the same control. */
function keepingFocus(render) {
    const focused = document.activeElement && document.activeElement.id;
    render();
    if (focused && document.activeElement === document.body && $(focused))
        $(focused).focus();
}

function pad(number) {
    return String(number).padStart(2, "0");
}

function localTime(iso) {
    const date = new Date(iso);
    if (Number.isNaN(date.getTime()))
        return iso;
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
        `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

function ago(iso) {
    const seconds = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (Number.isNaN(seconds))
        return "";
    if (seconds < 60)
        return "just now";
    if (seconds < 3600)
        return `${Math.floor(seconds / 60)} min ago`;
    if (seconds < 86400)
        return `${Math.floor(seconds / 3600)} h ago`;
    return `${Math.floor(seconds / 86400)} days ago`;
}

function when(iso) {
    return h("time", { datetime: iso, title: iso }, `${localTime(iso)} (${ago(iso)})`);
}

function listing(items) {
    if (items.length === 0)
        return "";
    if (items.length === 1)
        return items[0];
    return `${items.slice(0, -1).join(", ")} and ${items[items.length - 1]}`;
}

function sentences(failure) {
    return h("div", { class: "ca-sentences" }, failure.sentences.map(text => h("p", {}, text)));
}

/* -- the header, the problems, the tokens ---------------------------------------- */

function renderSummary() {
    const status = state.status;
    const summary = $("summary");
    if (!status) {
        summary.textContent = state.failure ? "Not available" : "Loading\u2026";
        return;
    }
    const tokens = Object.keys(status.tokens).length;
    const parts = [`${tokens} ${tokens === 1 ? "GPU" : "GPUs"}`];
    if (!status.corrupt)
        parts.push(`${status.leases.length} ${status.leases.length === 1 ? "lease" : "leases"}`);
    if (status.stranded.length)
        parts.push(`${status.stranded.length} stranded`);
    const poisoned = Object.values(status.tokens).filter(token => token.poisoned).length;
    if (poisoned)
        parts.push(`${poisoned} poisoned`);
    parts.push(status.corrupt ? "ledger damaged" : `ledger generation ${status.generation}`);
    summary.textContent = parts.join(" \u00b7 ");
}

function renderProblem() {
    const problem = $("problem");
    problem.replaceChildren();
    problem.hidden = !state.failure;
    if (!state.failure)
        return;
    const failure = state.failure;
    const title = {
        "not-installed": "charly-arbiter is not installed",
        "access-denied": "Administrative access is needed",
        lost: "Lost contact with charly-arbiter",
    }[failure.kind] || "charly-arbiter cannot show the GPUs";
    problem.append(h("div", { class: "ca-empty", id: "problem-box", "data-kind": failure.kind },
        h("h2", {}, title),
        sentences(failure),
        failure.kind === "lost" ? h("p", { class: "ca-muted" }, "Trying again in a few seconds.") : null,
        h("button", { type: "button", id: "retry", class: "ca-button ca-button-secondary", onclick: follow }, "Try again")));
}

function adminNote() {
    if (state.admin !== false)
        return null;
    return h("p", { class: "ca-muted" }, "Administrative access is needed to change anything: turn it on at the top of Cockpit.");
}

function alert(kind, id, title, body, actions) {
    return h("div", { class: `ca-alert ca-alert-${kind}`, id, role: kind === "success" ? "status" : null },
        h("h3", { class: "ca-alert-title" }, h("span", { class: "ca-visually-hidden" }, `${kind === "danger" ? "Danger" : kind === "warning" ? "Warning" : "Done"}: `), title),
        h("div", { class: "ca-alert-body" }, body),
        actions && actions.length ? h("div", { class: "ca-alert-actions" }, actions) : null);
}

function renderAlerts() {
    const alerts = $("alerts");
    const items = [];
    if (state.notice)
        items.push(alert("success", "notice", state.notice, []));
    const status = state.status;
    if (status && status.corrupt) {
        items.push(alert("danger", "alert-corrupt", "The ledger is damaged", [
            h("p", {}, `${status.corrupt}.`),
            h("p", {}, "Nothing is claimed, released or restored while it is damaged, and this page cannot say who holds the GPUs. " +
                "As root, run ", h("code", {}, "charly-arbiter recover"),
                ": it shows the backup against the host first, and writes only with --yes."),
        ]));
    }
    for (const lease of status ? status.leases : []) {
        if (!status.stranded.includes(lease.claimant))
            continue;
        const stopped = lease.stopped.length ? `starts again what was stopped for it (${listing(lease.stopped)}), ` : "";
        items.push(alert("warning", `alert-stranded-${safeId(lease.claimant)}`, `${lease.claimant} is stranded`, [
            h("p", {}, `Its ${lease.mode} lease on ${listing(lease.tokens)} will not end by itself: ${lease.stranded_why}.`),
            h("p", {}, `Restoring it ${stopped}sends ${listing(lease.tokens)} home and drops the lease.`),
            adminNote(),
        ], [h("button", {
            type: "button", class: "ca-button ca-button-primary", id: `restore-${safeId(lease.claimant)}`,
            disabled: state.admin === false || Boolean(status.corrupt),
            onclick: () => confirmRestore(lease.claimant),
        }, `Restore ${lease.claimant}\u2026`)]));
    }
    for (const [name, token] of Object.entries(status ? status.tokens : {})) {
        if (!token.poisoned)
            continue;
        items.push(alert("danger", `alert-poisoned-${safeId(name)}`, `${name} is poisoned`, [
            h("p", {}, token.since ? ["Since ", when(token.since), `: ${token.reason}.`] : `${token.reason}.`),
            h("p", {}, "Nothing will claim or switch it until the poison is cleared. Check the GPU and its driver by hand first (",
                h("code", {}, `lspci -nnk -s ${token.address}`), "), then clear the poison."),
            adminNote(),
        ], [h("button", {
            type: "button", class: "ca-button ca-button-danger", id: `clear-${safeId(name)}`,
            disabled: state.admin === false || Boolean(status.corrupt),
            onclick: () => confirmClear(name),
        }, `Clear the poison of ${name}\u2026`)]));
    }
    alerts.replaceChildren(...items);
    const restoreAll = $("restore-all");
    restoreAll.hidden = !(status && status.stranded.length > 1);
    restoreAll.disabled = state.admin === false || Boolean(status && status.corrupt);
}

const MODE_LABELS = { idle: "Idle", shared: "Shared", exclusive: "Exclusive", releasing: "Releasing", unknown: "Unknown" };

function tokenCard(name, token, status) {
    const leases = status.leases.filter(lease => token.claimants.includes(lease.claimant));
    const stopped = leases.flatMap(lease => lease.stopped);
    const holders = leases.length
        ? h("ul", { class: "ca-plain-list" }, leases.map(lease => {
            const notes = [lease.mode, lease.state];
            if (lease.transient)
                notes.push("transient");
            const stranded = status.stranded.includes(lease.claimant);
            return h("li", { class: "ca-holder" },
                h("strong", {}, lease.claimant), ` (${notes.join(", ")}) since `, when(lease.created),
                stranded ? h("span", { class: "ca-label ca-label-warning" }, "Stranded") : null);
        }))
        : status.corrupt ? "Unknown: the ledger is damaged" : "Nobody";
    const functions = h("ul", { class: "ca-plain-list" }, Object.entries(token.drivers).map(([address, driver]) =>
        h("li", {}, h("code", {}, address), " ", h("span", { class: driver === "vfio-pci" ? "ca-driver ca-driver-vfio" : "ca-driver" }, driver || "no driver"))));
    const mode = h("span", { class: `ca-label ca-label-${token.mode}` }, MODE_LABELS[token.mode] || token.mode);
    return h("article", { class: "ca-card ca-token", id: `token-${safeId(name)}`, "data-mode": token.mode, "data-poisoned": token.poisoned, "aria-labelledby": `token-title-${safeId(name)}` },
        h("header", { class: "ca-card-header" },
            h("h2", { id: `token-title-${safeId(name)}` }, name),
            h("span", { class: "ca-muted ca-address" }, token.address),
            h("span", { class: "ca-labels" }, mode, token.poisoned ? h("span", { class: "ca-label ca-label-danger" }, "Poisoned") : null)),
        h("dl", { class: "ca-dl" },
            h("dt", {}, "Functions"), h("dd", {}, functions),
            h("dt", {}, "Held by"), h("dd", { class: "ca-held-by" }, holders),
            h("dt", {}, "Stopped for it"), h("dd", { class: "ca-stopped" }, stopped.length ? listing(stopped) : status.corrupt ? "Unknown" : "Nothing"),
            token.poisoned ? [h("dt", {}, "Poisoned"), h("dd", {}, token.reason)] : null),
        h("footer", { class: "ca-card-footer" },
            h("button", { type: "button", class: "ca-button ca-button-link", id: `history-${safeId(name)}`, onclick: () => showHistoryOf(`t/${name}`) }, `History of ${name}`),
            leases.map(lease => h("button", {
                type: "button", class: "ca-button ca-button-link", id: `history-${safeId(name)}-${safeId(lease.claimant)}`,
                onclick: () => showHistoryOf(`c/${lease.claimant}`),
            }, `History of ${lease.claimant}`))));
}

function renderTokens() {
    const box = $("tokens");
    const status = state.status;
    if (!status) {
        box.replaceChildren();
        return;
    }
    const names = Object.keys(status.tokens).sort();
    if (!names.length) {
        box.replaceChildren(h("div", { class: "ca-empty" }, h("h2", {}, "No GPU found"),
            h("p", {}, "charly-arbiter found no GPU and no token in its configuration (charly-arbiter detect lists what it sees).")));
        return;
    }
    box.replaceChildren(...names.map(name => tokenCard(name, status.tokens[name], status)));
}

/* -- the history: timeline and list ---------------------------------------------- */

function renderSubjects() {
    const select = $("subject");
    const tokens = state.status ? Object.keys(state.status.tokens).sort() : [];
    const options = [h("option", { value: "" }, "every GPU and claimant")];
    options.push(...tokens.map(name => h("option", { value: `t/${name}` }, `GPU ${name}`)));
    options.push(...[...state.claimants].sort().map(name => h("option", { value: `c/${name}` }, name)));
    select.replaceChildren(...options);
    select.value = state.subject;
    if (select.value !== state.subject)
        select.value = "";
}

const EVENT_KINDS = {
    refused: "danger", failed: "danger", poisoned: "danger", "restore-failed": "danger",
    preempted: "warning", restore: "warning", "poison-cleared": "info",
};

function renderHistory() {
    const section = $("history");
    section.hidden = !state.status;
    if (!state.status)
        return;
    for (const event of state.history || []) {
        for (const who of [event.claimant, event.holder])
            if (who)
                state.claimants.add(who);
    }
    for (const lease of state.status.leases)
        state.claimants.add(lease.claimant);
    renderSubjects();
    const box = $("timeline");
    const body = $("events").tBodies[0];
    if (state.historyFailure) {
        box.replaceChildren(h("div", { class: "ca-alert ca-alert-danger ca-alert-inline" }, sentences(state.historyFailure)));
        body.replaceChildren();
        return;
    }
    if (state.history === null) {
        box.replaceChildren(pending("Reading the history\u2026"));
        body.replaceChildren();
        return;
    }
    const model = buildTimeline(state.history, Date.now() / 1000);
    const svg = drawTimeline(model, Math.max(280, box.clientWidth || 600));
    const label = `Timeline of ${$("subject").selectedOptions[0]?.textContent || "every GPU"}: ` +
        (model.lanes.length ? model.lanes.map(lane => `${lane.name}, ${lane.bars.length} periods, ${lane.marks.length} marks`).join("; ") : "no events");
    svg.setAttribute("aria-label", label);
    box.replaceChildren(svg);
    const rows = [...state.history].reverse().slice(0, 300).map(event => h("tr", { class: event.interrupted ? "ca-row-interrupted" : null, "data-event": event.event },
        h("td", { class: "ca-nowrap" }, h("time", { datetime: event.time }, localTime(event.time))),
        h("td", {}, h("span", { class: `ca-label ca-label-${EVENT_KINDS[event.event] || "plain"}` }, event.event)),
        h("td", {}, event.message || "", event.interrupted ? h("strong", {}, " (the process died during this step)") : null)));
    if (!rows.length)
        rows.push(h("tr", {}, h("td", { colspan: 3, class: "ca-muted" }, "No events in the last 24 hours.")));
    body.replaceChildren(...rows);
}

function showHistoryOf(subject) {
    state.subject = subject;
    renderSubjects();
    fetchHistory();
    $("subject").focus();
    $("history").scrollIntoView({ block: "start" });
}

let historyRequest = 0;
let historyTimer = null;

function refreshHistory() {
    clearTimeout(historyTimer);
    historyTimer = setTimeout(fetchHistory, 200);
}

async function fetchHistory() {
    const request = ++historyRequest;
    const args = ["history", "--json", "--since", "1d"];
    if (state.subject.startsWith("t/"))
        args.push("--token", state.subject.slice(2));
    else if (state.subject.startsWith("c/"))
        args.push("--claimant", state.subject.slice(2));
    try {
        const events = await runJson(args);
        if (request !== historyRequest)
            return;
        state.history = events;
        state.historyFailure = null;
    } catch (failure) {
        if (request !== historyRequest)
            return;
        state.historyFailure = failure;
    }
    keepingFocus(renderHistory);
    document.documentElement.dataset.historyRequests = String(request);
}

/* -- the dialog: the plan first, then the action --------------------------------- */

let dialogAction = null;
let dialogOpener = null; // the control to give the focus back to (by id: it may be re-rendered)

function openDialog({ title, confirm, danger = false, body, action }) {
    const dialog = $("dialog");
    dialogOpener = document.activeElement && document.activeElement.id;
    $("dialog-title").textContent = title;
    $("dialog-body").replaceChildren(...[].concat(body));
    $("dialog-error").replaceChildren();
    const button = $("dialog-confirm");
    button.textContent = confirm;
    button.className = `ca-button ${danger ? "ca-button-danger" : "ca-button-primary"}`;
    button.disabled = true;
    button.dataset.label = confirm;
    dialogAction = action;
    dialog.showModal();
    $("dialog-cancel").focus();
}

function dialogReady(ready) {
    $("dialog-confirm").disabled = !ready;
    if (ready)
        $("dialog-confirm").focus();
}

function dialogFailed(failure) {
    $("dialog-error").replaceChildren(h("div", { class: "ca-alert ca-alert-danger ca-alert-inline" },
        h("h3", { class: "ca-alert-title" }, failure.kind === "refused" ? "Refused" : "It did not work"),
        sentences(failure)));
}

function closeDialog() {
    const dialog = $("dialog");
    if (dialog.open)
        dialog.close(); // the close event hands the focus back
    dialogAction = null;
}

async function runDialogAction() {
    if (!dialogAction)
        return;
    const button = $("dialog-confirm");
    button.disabled = true;
    button.textContent = `${button.dataset.label}\u2026`;
    $("dialog-error").replaceChildren();
    try {
        const notice = await dialogAction();
        if (notice === undefined) { // a preview: the dialog stays open
            button.textContent = button.dataset.label;
            button.disabled = false;
            return;
        }
        closeDialog();
        state.notice = notice;
        keepingFocus(renderAlerts);
    } catch (failure) {
        dialogFailed(failure instanceof ArbiterFailure ? failure : new ArbiterFailure("failed", [String(failure)]));
        button.textContent = button.dataset.label;
        button.disabled = false;
    }
}

function pending(text) {
    return h("p", { class: "ca-muted ca-pending" }, h("span", { class: "ca-spinner", "aria-hidden": "true" }), text);
}

function restorePlan(plan) {
    if (!plan.claimants.length)
        return [h("p", {}, "Nothing would be restored now: no such lease is stranded any more, or its claimant runs again.")];
    return [h("p", {}, "Restoring would, for each lease:"),
        h("ul", { class: "ca-plan" }, plan.claimants.map(item => h("li", { "data-claimant": item.claimant },
            h("strong", {}, item.claimant), ` (${item.mode} on ${listing(item.tokens)}, ${item.state}): `,
            item.start_again.length ? `start ${listing(item.start_again)} again, ` : "",
            `send ${listing(item.tokens)} home unless another lease still holds it, and drop the lease.`))),
    h("p", { class: "ca-muted" }, "A holder whose GPU another claimant now holds exclusively stays stopped until that lease ends.")];
}

async function confirmRestore(claimant) {
    const which = claimant ? [claimant] : ["--stranded"];
    openDialog({
        title: claimant ? `Restore ${claimant}?` : "Restore every stranded claimant?",
        confirm: "Restore",
        body: pending("Checking what it would do\u2026"),
        action: async () => {
            const done = await runJson(["restore", "--json", ...which], { admin: true });
            const names = done.claimants.map(item => item.claimant);
            return names.length ? `Restored ${listing(names)}.` : "Nothing needed restoring.";
        },
    });
    try {
        const plan = await runJson(["restore", "--dry-run", "--json", ...which]);
        $("dialog-body").replaceChildren(...restorePlan(plan));
        dialogReady(plan.claimants.length > 0);
    } catch (failure) {
        $("dialog-body").replaceChildren();
        dialogFailed(failure);
    }
}

function confirmClear(name) {
    const token = state.status.tokens[name];
    const drivers = Object.entries(token.drivers).map(([address, driver]) => `${address} on ${driver || "no driver"}`);
    openDialog({
        title: `Clear the poison of ${name}?`,
        confirm: "Clear the poison",
        danger: true,
        body: [
            h("p", {}, `${name} (${token.address}) was poisoned`, token.since ? [" since ", when(token.since)] : "", `: ${token.reason}.`),
            h("p", {}, `Clearing lets claims on ${name} again. It changes no driver: its functions stay as they are (${listing(drivers)}).`),
            h("p", {}, "Clear it only once the GPU and its driver have been checked by hand (", h("code", {}, `lspci -nnk -s ${token.address}`), ")."),
        ],
        action: async () => {
            const result = await runJson(["poison", "clear", "--json", name], { admin: true });
            return result.cleared ? `Cleared the poison of ${name}.` : `${name} was not poisoned any more.`;
        },
    });
    dialogReady(true);
}

function planView(domain, plan) {
    if (plan.refused)
        return [h("div", { class: "ca-alert ca-alert-warning ca-alert-inline", id: "plan-result", "data-outcome": "refused" },
            h("h3", { class: "ca-alert-title" }, `Starting ${domain} would be refused`),
            h("p", {}, plan.refused), plan.hint ? h("p", {}, `Hint: ${plan.hint}`) : null)];
    if (plan.claims_nothing)
        return [h("p", { id: "plan-result", "data-outcome": "nothing" }, `${domain} claims no GPU: starting it changes nothing here.`)];
    const tokens = listing(plan.tokens);
    if (plan.already_held)
        return [h("p", { id: "plan-result", "data-outcome": "held" }, `${plan.claimant} already holds ${tokens} (${plan.mode}): nothing to do.`)];
    const source = plan.from_definition ? "Its definition claims" : "Claiming";
    const parts = [h("p", {}, `${source} ${tokens} (${plan.mode}): ${plan.claimant} can claim ${plan.tokens.length === 1 ? "it" : "them"}.`)];
    parts.push(plan.stops.length
        ? [h("p", {}, "Starting it would stop, in this order:"),
            h("ol", { class: "ca-plan" }, plan.stops.map(stop => h("li", {}, h("strong", {}, stop.holder), ` (${stop.how}${stop.shared_tokens.length ? `, whose shared lease on ${listing(stop.shared_tokens)} it takes over` : ""})`)))]
        : h("p", {}, "Starting it would stop nothing."));
    parts.push(plan.switches.length
        ? [h("p", {}, "It would switch:"),
            h("table", { class: "ca-table ca-table-compact" },
                h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "GPU"), h("th", { scope: "col" }, "Function"), h("th", { scope: "col" }, "From"), h("th", { scope: "col" }, "To"))),
                h("tbody", {}, plan.switches.map(step => h("tr", {}, h("td", {}, step.token), h("td", {}, h("code", {}, step.address)), h("td", {}, step.from || "no driver"), h("td", {}, step.to)))))]
        : h("p", {}, "It would switch no driver."));
    if (plan.stops.length)
        parts.push(h("p", {}, `When ${domain} stops, ${listing(plan.stops.map(stop => stop.holder))} would be started again.`));
    parts.push(h("p", { class: "ca-muted" }, "Nothing was changed: this is a preview."));
    return [h("div", { id: "plan-result", "data-outcome": "plan" }, parts)];
}

function chooseTokens() {
    const mode = document.querySelector("input[name=plan-mode]:checked").value;
    $("plan-tokens").disabled = mode === "definition";
}

function previewStart() {
    const tokens = Object.keys(state.status.tokens).sort();
    const domains = [...state.claimants].filter(name => name.startsWith("libvirt:")).map(name => name.slice(8));
    const result = h("div", { class: "ca-plan-result", "aria-live": "polite" });
    const form = h("div", { class: "ca-form" },
        h("label", { for: "plan-domain" }, "Virtual machine (libvirt domain name)"),
        h("input", { id: "plan-domain", class: "ca-input", type: "text", list: "plan-domains", required: true, autocomplete: "off", spellcheck: "false" }),
        h("datalist", { id: "plan-domains" }, domains.map(name => h("option", { value: name }))),
        h("fieldset", { onchange: chooseTokens }, h("legend", {}, "Claim"),
            h("label", { class: "ca-check" }, h("input", { type: "radio", name: "plan-mode", value: "definition", checked: true }), " what its libvirt definition says (as its start would read it)"),
            h("label", { class: "ca-check" }, h("input", { type: "radio", name: "plan-mode", value: "exclusive" }), " exclusive (PCI passthrough, vfio-pci) of the GPUs below"),
            h("label", { class: "ca-check" }, h("input", { type: "radio", name: "plan-mode", value: "shared" }), " shared (vGPU, on the home driver) of the GPUs below")),
        h("fieldset", { id: "plan-tokens", disabled: true }, h("legend", {}, "GPUs"),
            tokens.map((name, index) => h("label", { class: "ca-check" },
                h("input", { type: "checkbox", name: "plan-token", value: name, checked: index === 0 }), ` ${name}`))),
        result);
    openDialog({
        title: "Preview a VM start",
        confirm: "Preview",
        body: [h("p", { class: "ca-muted" }, "What starting the VM would stop and switch, decided the way its start would decide it; nothing is changed."), form],
        action: null,
    });
    dialogAction = async () => {
        const domain = $("plan-domain").value.trim();
        const chosen = [...document.querySelectorAll("input[name=plan-token]:checked")].map(input => input.value);
        const mode = document.querySelector("input[name=plan-mode]:checked").value;
        if (!domain || (mode !== "definition" && !chosen.length))
            throw new ArbiterFailure("failed", ["Name the VM, and choose at least one GPU unless its definition says which."]);
        const args = mode === "definition"
            ? ["plan", "--json", "--", `libvirt:${domain}`]
            : ["plan", "--json", `--${mode}`, "--", `libvirt:${domain}`, ...chosen];
        result.replaceChildren(pending("Planning\u2026"));
        try {
            const plan = await runJson(args, { jsonOnFailure: true });
            result.replaceChildren(...planView(domain, plan));
        } catch (failure) {
            result.replaceChildren();
            throw failure;
        }
        return undefined;
    };
    dialogReady(true);
    $("plan-domain").focus();
}

/* -- following the arbiter -------------------------------------------------------- */

function renderAll() {
    keepingFocus(() => {
        renderSummary();
        renderProblem();
        renderAlerts();
        renderTokens();
        renderHistory();
        $("preview").disabled = !state.status || Boolean(state.status.corrupt);
    });
}

function follow() {
    clearTimeout(retryTimer);
    if (stopFollowing)
        stopFollowing();
    stopFollowing = followStatus(
        document_ => {
            const first = state.status === null;
            state.status = document_;
            state.failure = null;
            renderAll();
            refreshHistory();
            if (first && !document.documentElement.dataset.firstRenderMs) {
                document.documentElement.dataset.firstRenderMs = String(Math.round(performance.now()));
                $("page").setAttribute("aria-busy", "false");
            }
            document.documentElement.dataset.generation = String(document_.generation);
        },
        failure => {
            stopFollowing = null;
            state.failure = failure;
            if (failure.kind !== "lost")
                state.status = null;
            renderAll();
            $("page").setAttribute("aria-busy", "false");
            if (failure.kind === "lost")
                retryTimer = setTimeout(follow, 5000);
        });
}

function watchVisibility() {
    // Cockpit keeps a visited page's frame; a hidden page follows nothing.
    cockpit.addEventListener("visibilitychange", () => {
        if (cockpit.hidden && stopFollowing) {
            stopFollowing();
            stopFollowing = null;
        } else if (!cockpit.hidden && !stopFollowing) {
            follow();
        }
    });
}

function watchPermission() {
    const permission = cockpit.permission({ admin: true });
    const update = () => {
        state.admin = permission.allowed;
        renderAll();
    };
    permission.addEventListener("changed", update);
    update();
}

async function main() {
    $("dialog-confirm").addEventListener("click", () => {
        runDialogAction().catch(() => {});
    });
    $("dialog-cancel").addEventListener("click", closeDialog);
    $("dialog").addEventListener("close", () => {
        dialogAction = null;
        if (dialogOpener && $(dialogOpener))
            $(dialogOpener).focus();
    });
    $("dialog-form").addEventListener("submit", event => {
        event.preventDefault();
        runDialogAction();
    });
    $("restore-all").addEventListener("click", () => confirmRestore(null));
    $("preview").addEventListener("click", previewStart);
    $("subject").addEventListener("change", event => {
        state.subject = event.target.value;
        fetchHistory();
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
        clearTimeout(resizeTimer);
        resizeTimer = setTimeout(() => keepingFocus(renderHistory), 150);
    });
    // Ages ("3 min ago") and the timeline's "now" move on; nothing is asked again.
    setInterval(() => { if (state.status && !cockpit.hidden) renderAll() }, 30000);
    await loadConfig();
    watchPermission();
    watchVisibility();
    follow();
}

main();
