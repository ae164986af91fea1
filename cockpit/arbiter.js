/* The page's one door to charly-arbiter: its command line, with --json, spawned
 * through cockpit-bridge.  The page never reads the ledger or the history itself.
 *
 * Which command runs comes from this package's manifest ("config"), which an
 * administrator (or a test) overrides in /etc/cockpit/charly-arbiter.override.json
 * or ~/.config/cockpit/charly-arbiter.override.json, e.g. for a from-source install:
 *   {"config": {"command": ["/usr/local/bin/charly-arbiter"],
 *               "environ": ["CHARLY_ARBITER_CONFIG=/etc/charly-arbiter/lab.toml"]}}
 */

const config = { command: ["charly-arbiter"], environ: [] };

export async function loadConfig() {
    try {
        const response = await fetch("../manifests.json", { credentials: "same-origin" });
        const manifests = await response.json();
        const mine = (manifests["charly-arbiter"] || {}).config || {};
        if (Array.isArray(mine.command) && mine.command.length > 0)
            config.command = mine.command.map(String);
        if (Array.isArray(mine.environ))
            config.environ = mine.environ.map(String);
    } catch (error) {
        console.warn("charly-arbiter: could not read the manifests; using charly-arbiter from PATH", error);
    }
    return config;
}

/* What went wrong, in the CLI's own words where it said any. */
export class ArbiterFailure extends Error {
    constructor(kind, sentences, details = "") {
        super(sentences.join(" "));
        this.kind = kind; // "not-installed", "access-denied", "refused", "failed", "lost"
        this.sentences = sentences;
        this.details = details;
    }
}

/* The CLI prints "charly-arbiter: SENTENCE" and maybe "hint: WHAT TO DO" last on
 * stderr (progress lines may come before): those are the one or two sentences. */
export function cliSentences(stderr) {
    const lines = (stderr || "").split("\n").map(line => line.trim()).filter(Boolean);
    let hint = null;
    if (lines.length && lines[lines.length - 1].startsWith("hint: "))
        hint = lines.pop();
    const last = lines.pop();
    const sentences = [];
    if (last)
        sentences.push(last.replace(/^charly-arbiter: /, ""));
    if (hint)
        sentences.push(hint.replace(/^hint: /, "Hint: "));
    return sentences;
}

function failure(ex, stderr) {
    const program = "charly-arbiter";
    if (ex.problem === "not-found")
        return new ArbiterFailure("not-installed", [
            `${config.command[0]} is not installed on this machine.`,
            "Install the charly-arbiter package (apt install charly-arbiter, or dnf install charly-arbiter).",
        ]);
    if (ex.problem === "access-denied")
        return new ArbiterFailure("access-denied", [
            "This needs administrative access.",
            "Turn it on with the \u201cLimited access\u201d button at the top of Cockpit.",
        ]);
    if (ex.problem)
        return new ArbiterFailure("failed", [`${program}: ${cockpit.message(ex)}`]);
    const code = ex.exit_status;
    if (code === null || code === undefined) // killed: whatever it printed is not its answer
        return new ArbiterFailure("killed", [`${program} was killed (signal ${ex.exit_signal}).`], stderr || "");
    const sentences = cliSentences(stderr);
    if (!sentences.length)
        sentences.push(`${program} exited with status ${code}.`);
    return new ArbiterFailure(code === 3 ? "refused" : "failed", sentences, stderr || "");
}

function spawn(args, admin) {
    return cockpit.spawn([...config.command, ...args], {
        superuser: admin ? "require" : "try",
        err: "message",
        environ: config.environ,
    });
}

/* Run `charly-arbiter ARGS` and parse its JSON stdout.  `admin`: as Cockpit's
 * superuser (the actions); otherwise as it if the user has it turned on.
 * `jsonOnFailure`: a command that explains a refusal in JSON on stdout (plan). */
export function runJson(args, { admin = false, jsonOnFailure = false } = {}) {
    return new Promise((resolve, reject) => {
        spawn(args, admin).then(
            output => {
                try {
                    resolve(JSON.parse(output));
                } catch (error) {
                    reject(new ArbiterFailure("failed", [`charly-arbiter ${args[0]} printed no JSON: ${error}`]));
                }
            },
            (ex, output) => {
                if (jsonOnFailure && output && ex.exit_status === 3) {
                    try {
                        resolve(JSON.parse(output));
                        return;
                    } catch (error) { /* fall through to the error */ }
                }
                reject(failure(ex, ex.message));
            });
    });
}

/* `status --json --follow`: onDocument(status) for every line, onEnd(failure|null)
 * when the process ends.  Returns a function that stops following. */
export function followStatus(onDocument, onEnd) {
    performance.mark("charly-arbiter:spawn");
    const process = spawn(["status", "--json", "--follow"], false);
    let buffer = "";
    let first = true;
    process.stream(chunk => {
        if (first) {
            first = false;
            performance.mark("charly-arbiter:first-output");
        }
        buffer += chunk;
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
            const line = buffer.slice(0, end);
            buffer = buffer.slice(end + 1);
            if (!line.trim())
                continue;
            try {
                onDocument(JSON.parse(line));
            } catch (error) {
                console.error("charly-arbiter: unreadable status line", error, line);
            }
        }
    });
    let stopped = false;
    process.then(
        () => { if (!stopped) onEnd(new ArbiterFailure("lost", ["charly-arbiter status --follow ended."])) },
        ex => {
            if (stopped)
                return;
            const ended = failure(ex, ex.message);
            // A follower that was working and got killed (OOM, an operator): follow again.
            onEnd(ended.kind === "killed" ? new ArbiterFailure("lost", ended.sentences) : ended);
        });
    return () => {
        stopped = true;
        process.close("terminated");
    };
}
