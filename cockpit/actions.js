/* The GPUs page's actions, each in the one modal dialog: the plan first (a dry
 * run, or what `status` says), then the command, as Cockpit's superuser.  A
 * preview (`plan`) is all plan and no action. */

import { ArbiterFailure, runJson } from "./arbiter.js";
import { $, h, listing, pending, sentences, when } from "./dom.js";

let dialogAction = null;
let done = () => {}; // what the page does with the notice of an action that worked
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
        done(notice);
    } catch (failure) {
        dialogFailed(failure instanceof ArbiterFailure ? failure : new ArbiterFailure("failed", [String(failure)]));
        button.textContent = button.dataset.label;
        button.disabled = false;
    }
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

export async function confirmRestore(claimant) {
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

export function confirmClear(name, token) {
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

/* `tokens`: the names to offer; `domains`: libvirt domains the page has seen. */
export function previewStart(tokens, domains) {
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

/* Wire the one dialog of the page; `onDone(notice)` after an action worked. */
export function initDialog(onDone) {
    done = onDone;
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
}
