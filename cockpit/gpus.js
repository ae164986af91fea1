/* Cockpit's GPUs page: every token, who holds it and since when, what was stopped
 * for it, what is stranded or poisoned and how to fix it, and the history as a
 * timeline.  Everything comes from charly-arbiter's --json outputs (arbiter.js);
 * the page stays current through one `status --json --follow` process, which
 * prints a line only when the ledger, the history or the state changed. */

import { confirmClear, confirmRestore, initDialog, previewStart } from "./actions.js";
import { followStatus, loadConfig, runJson } from "./arbiter.js";
import { $, h, keepingFocus, listing, localTime, pending, safeId, sentences, when } from "./dom.js";
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
    for (const name of status && status.sleep ? status.sleep.missing : []) {
        const lease = status.leases.find(lease => lease.tokens.includes(name) && lease.mode === "exclusive");
        const cause = (lease && lease.sleep_lock_error) || status.sleep.unavailable || "its logind inhibitor lock is not held";
        items.push(alert("warning", `alert-sleep-${safeId(name)}`, `Sleep is not blocked while ${name} is passed through`, [
            h("p", {}, `${cause}.`),
            h("p", {}, `The host may suspend under ${lease ? lease.claimant : "the VM"}, which would lose its GPU. Once the host can hold the lock (systemd running), run `,
                h("code", {}, "charly-arbiter restore --stranded"), ", which takes it; or set ", h("code", {}, 'sleep = "allow"'), " in arbiter.toml to accept it."),
        ]));
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
            onclick: () => confirmClear(name, token),
        }, `Clear the poison of ${name}\u2026`)]));
    }
    alerts.replaceChildren(...items);
    const restoreAll = $("restore-all");
    restoreAll.hidden = !(status && status.stranded.length > 1);
    restoreAll.disabled = state.admin === false || Boolean(status && status.corrupt);
}

/* Whether the host may suspend while the token is passed through (status.sleep). */
function sleepRow(name, token, status) {
    const sleep = status.sleep;
    if (!sleep)
        return null;
    let text = null;
    let kind = null;
    if (token.sleep_blocked) {
        text = `Sleep blocked while ${token.sleep_blocked}`;
        kind = "blocked";
    } else if (sleep.missing.includes(name)) {
        text = "Not blocked: the host may suspend while it is passed through";
        kind = "missing";
    } else if (sleep.policy === "allow" && token.mode === "exclusive") {
        text = 'Allowed while it is passed through (sleep = "allow")';
        kind = "allowed";
    }
    if (!text)
        return null;
    return [h("dt", {}, "Sleep"), h("dd", { class: "ca-sleep", id: `sleep-${safeId(name)}`, "data-sleep": kind }, text)];
}

const MODE_LABELS = { idle: "Idle", shared: "Shared", exclusive: "Exclusive", releasing: "Releasing", "in-use": "In use", unaccounted: "Unaccounted", unknown: "Unknown" };

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
            sleepRow(name, token, status),
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
    historyTimer = setTimeout(fetchHistory, 100); // one fetch for a burst of lines
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
    performance.mark("charly-arbiter:history");
    document.documentElement.dataset.historyRequests = String(request);
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
            if (first)
                fetchHistory(); // at once: the first status is already on screen
            else
                refreshHistory();
            if (first && !document.documentElement.dataset.firstRenderMs) {
                document.documentElement.dataset.firstRenderMs = String(Math.round(performance.now()));
                $("page").setAttribute("aria-busy", "false");
            }
            document.documentElement.dataset.generation = String(document_.generation);
            // What bench/bench_page.py reads: when each generation was on screen.
            performance.mark(first ? "charly-arbiter:first-status" : "charly-arbiter:status",
                { detail: { generation: document_.generation } });
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
    performance.mark("charly-arbiter:script");
    initDialog(notice => {
        state.notice = notice;
        keepingFocus(renderAlerts);
    });
    $("restore-all").addEventListener("click", () => confirmRestore(null));
    $("preview").addEventListener("click", () => previewStart(
        Object.keys(state.status.tokens).sort(),
        [...state.claimants].filter(name => name.startsWith("libvirt:")).map(name => name.slice(8))));
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
    performance.mark("charly-arbiter:config");
    follow(); // first: the follower's interpreter starts while the rest is set up
    watchPermission();
    watchVisibility();
}

main();
