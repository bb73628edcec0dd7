// The dashboard in a real browser (Chromium through playwright-core).
//
// Environment: DASHBOARD_URL (the demo's), LABEL (names the screenshots),
// QUEUES (the demo's `reports,images` queue names), SOURCE (the native
// source's name), SHOTS (where screenshots go), OPERATOR_PASSWORD and
// READER_PASSWORD; EDGE=1 to check the edge source `edge` too (its keeper
// holds at least EDGE_RECORDS records made by the edge test step).
//
// Exits non-zero with the first mismatch.
import { chromium } from "playwright-core";
import { mkdirSync } from "node:fs";

const url = process.env.DASHBOARD_URL;
const label = process.env.LABEL || "memory";
const [reports, images] = (process.env.QUEUES || "reports,images").split(",");
const source = process.env.SOURCE;
const shots = process.env.SHOTS || "target/web/screenshots";
const operator = { username: "alice", password: process.env.OPERATOR_PASSWORD || "alice-password" };
const reader = { username: "bob", password: process.env.READER_PASSWORD || "bob-password" };
mkdirSync(shots, { recursive: true });

let checks = 0;
function check(cond, what) {
  if (!cond) {
    console.error(`FAILED (${label}): ${what}`);
    process.exit(1);
  }
  checks += 1;
  console.log(`ok - ${what}`);
}

const list = (extra = {}) =>
  `${url}/failures?` + new URLSearchParams({ source, ...extra }).toString();

async function shot(page, name) {
  await page.screenshot({ path: `${shots}/${label}-${name}.png`, fullPage: true });
}

async function rows(page) {
  return page.locator("#records tbody tr[data-id]").count();
}

async function matched(page) {
  return Number((await page.locator("#matched").innerText()).replace(/,/g, ""));
}

// Clicks `selector` and waits for the page it leads to.
async function go(page, selector) {
  await Promise.all([page.waitForNavigation(), page.click(selector)]);
}

// --- without credentials -------------------------------------------------
{
  const bare = await fetch(`${url}/failures`);
  check(bare.status === 401, `a request without credentials is refused (got ${bare.status})`);
  check((bare.headers.get("www-authenticate") || "").startsWith("Basic"), "and asked for Basic credentials");
  const wrong = await fetch(`${url}/`, {
    headers: { authorization: "Basic " + Buffer.from("alice:not-her-password").toString("base64") },
  });
  check(wrong.status === 401, `a wrong password is refused (got ${wrong.status})`);
  const asset = await fetch(`${url}/assets/style.css`);
  check(asset.status === 401, "even the stylesheet needs credentials");
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
try {
  // --- the operator -------------------------------------------------------
  const ctx = await browser.newContext({ httpCredentials: operator, viewport: { width: 1366, height: 900 } });
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

  await page.goto(`${url}/`);
  check(await page.locator("#queues").isVisible(), "the overview shows the queues");
  const overview = await page.locator("#queues").innerText();
  check(overview.includes(reports) && overview.includes(images), "with both queues of the demo");
  const styled = await page.evaluate(() => getComputedStyle(document.querySelector("header.top")).backgroundColor);
  check(styled === "rgb(21, 26, 45)", `the stylesheet applies (header ${styled})`);
  check((await page.locator("#rates").count()) === 1, "the settlement rates are shown");
  check((await page.locator("#breakers").innerText()).includes("crm"), "the crm breaker is listed");
  await shot(page, "overview");

  await page.goto(`${url}/jobs`);
  const jobsText = await page.locator("main").innerText();
  check(jobsText.includes("send-report") && jobsText.includes("resize-image"), "the jobs page lists the jobs");
  const sync = page.locator("tr[data-job=sync-crm]");
  check(Number(await sync.getAttribute("data-succeeded")) === 20, "sync-crm's 20 successes are counted");

  await page.goto(list({ queue: reports }));
  const total = await rows(page);
  check(total >= 9, `the failures page lists the report records (${total} rows)`);
  check(await page.locator("#records th").first().locator("input[data-select-all]").count() === 1, "with a select-all box");
  await shot(page, "failures");

  // Filters.
  await page.selectOption("select[name=job]", "send-report");
  await page.fill("input[name=q]", "template");
  await go(page, "#filters button[type=submit]");
  check((await rows(page)) === 3 && (await matched(page)) === 3, "filtering by job and text keeps the 3 matching records");
  check(page.url().includes("q=template"), "the filter is in the address, to share");
  await page.goto(list({ queue: images, kind: "attempts_exhausted" }));
  check((await rows(page)) === 3, "filtering by kind finds the 3 records that ran out of deliveries");
  await page.goto(list({ queue: images, kind: "permanent" }));
  check((await rows(page)) === 0, "and none of them is permanent");
  await page.goto(list({ queue: reports, age: "1h" }));
  check((await rows(page)) === Math.min(total, 50), "every record failed within the hour");
  await page.goto(list({ queue: reports, age: "old" }));
  check((await rows(page)) === 0, "none is older than 7 days");

  // A record's page, and a replay of it.
  await page.goto(list({ queue: reports, q: "no email" }));
  const id = await page.locator("#records tbody tr[data-id]").first().getAttribute("data-id");
  await go(page, `#records tr[data-id="${id}"] a`);
  check(await page.locator("#fields").isVisible(), "a record's page shows its fields");
  check((await page.locator("#fields").innerText()).includes("no email address on file"), "with its reason");
  check(await page.locator("#payload-hidden").isVisible(), "and hides the payload (not opted in)");
  await shot(page, "record");
  await go(page, "form[data-mutation] button[value=replay-selected]");
  check(await page.locator("#confirm").isVisible(), "a replay asks for confirmation first");
  await shot(page, "confirm");
  await go(page, "#confirm-button");
  check((await page.locator("#notice").innerText()).includes("Replayed 1 of 1"), "the replay is reported");
  await page.goto(list({ queue: reports }));
  check((await page.locator(`tr[data-id="${id}"]`).count()) === 0, "the replayed record left the list");
  check((await rows(page)) === total - 1, "one row fewer");
  // The job ran again (its handler succeeds on a replay).
  let ran = false;
  for (let i = 0; i < 50 && !ran; i += 1) {
    await page.goto(`${url}/jobs`);
    ran = Number(await page.locator("tr[data-job=send-report]").getAttribute("data-succeeded")) >= 1;
    if (!ran) await page.waitForTimeout(200);
  }
  check(ran, "the replayed job ran and succeeded (jobs page)");
  await shot(page, "jobs");

  // Replay of a selection.
  await page.goto(list({ queue: images }));
  const boxes = page.locator("#records input[name=id]");
  await boxes.nth(0).check();
  await boxes.nth(1).check();
  await go(page, "button[value=replay-selected]");
  check((await page.locator("#confirm").innerText()).includes("2 records"), "replaying a selection confirms its size");
  await go(page, "#confirm-button");
  check((await page.locator("#notice").innerText()).includes("Replayed 2 of 2"), "the two selected records are replayed");
  check((await rows(page)) === 1, "one image record is left");

  // Bulk purge by filter.
  await page.goto(list({ queue: reports, q: "mailbox" }));
  const mailbox = await matched(page);
  check(mailbox === 3, "three records match `mailbox`");
  await go(page, "button[value=purge-matching]");
  check((await page.locator("#confirm").innerText()).includes("every record matching"), "purging by filter confirms the filter");
  await go(page, "#confirm-button");
  check((await page.locator("#notice").innerText()).includes("Purged 3 of 3"), "the matching records are purged");
  check((await matched(page)) === 0, "none matches any more");
  await page.goto(list({ queue: reports }));
  check((await rows(page)) === total - 4, "the others stay");

  // Mutations without the form's token, or from another site.
  const form = { do: "purge-matching", source, queue: reports, confirm: "yes" };
  const noToken = await ctx.request.post(`${url}/failures/action`, { form });
  check(noToken.status() === 403, `a purge without the CSRF token is refused (${noToken.status()})`);
  const csrf = await page.locator("form[data-mutation] input[name=csrf]").first().inputValue();
  const crossSite = await ctx.request.post(`${url}/failures/action`, {
    form: { ...form, csrf },
    headers: { origin: "https://elsewhere.example" },
  });
  check(crossSite.status() === 403, `a purge from another origin is refused (${crossSite.status()})`);
  await page.goto(list({ queue: reports }));
  check((await rows(page)) === total - 4, "nothing was purged by them");

  await page.goto(`${url}/schedules`);
  check((await page.locator("main").innerText()).includes("nightly-digest"), "the schedules page lists the schedules");
  await shot(page, "schedules");

  // --- the edge -------------------------------------------------------------
  if (process.env.EDGE === "1") {
    await page.goto(`${url}/failures?source=edge`);
    const edgeRows = await rows(page);
    const want = Number(process.env.EDGE_RECORDS || "1");
    check(edgeRows >= want, `the edge keeper's records are listed (${edgeRows}, at least ${want})`);
    await shot(page, "edge-failures");
    const first = await page.locator("#records tbody tr[data-id]").first().getAttribute("data-id");
    await go(page, `#records tr[data-id="${first}"] a`);
    check(await page.locator("#fields").isVisible(), "an edge record's page shows its fields");
    await go(page, "form[data-mutation] button[value=purge-selected]");
    await go(page, "#confirm-button");
    check((await page.locator("#notice").innerText()).includes("Purged 1 of 1"), "an edge record is purged through the keeper");
    check((await page.locator(`tr[data-id="${first}"]`).count()) === 0, "and left the edge list");
    if (edgeRows > 1) {
      const second = await page.locator("#records tbody tr[data-id]").first().getAttribute("data-id");
      await page.locator(`#records tr[data-id="${second}"] input[name=id]`).check();
      await go(page, "button[value=replay-selected]");
      await go(page, "#confirm-button");
      const notice = await page.locator("#notice").innerText();
      check(notice.includes("Replayed 1 of 1"), `an edge record is replayed through the keeper (${notice})`);
    }
  }

  check(errors.length === 0, `no script or policy errors in the pages (${errors.slice(0, 3).join("; ").slice(0, 600)})`);

  // --- the read-only role -------------------------------------------------
  const ro = await browser.newContext({ httpCredentials: reader, viewport: { width: 1366, height: 900 } });
  const view = await ro.newPage();
  await view.goto(list({ queue: reports }));
  check((await rows(view)) === total - 4, "the read-only role sees the records");
  check((await view.locator("form[data-mutation]").count()) === 0, "but no form that changes anything");
  check((await view.locator("input[name=id], button[value^=replay], button[value^=purge]").count()) === 0, "and no selection or button");
  await shot(view, "failures-read-only");
  const someId = await view.locator("#records tbody tr[data-id]").first().getAttribute("data-id");
  await go(view, `#records tr[data-id="${someId}"] a`);
  check((await view.locator("form[data-mutation]").count()) === 0, "a record's page offers the read-only role no replay or purge");
  const byHand = await ro.request.post(`${url}/failures/action`, {
    form: { do: "purge-selected", source, queue: reports, id: someId, confirm: "yes", csrf },
  });
  check(byHand.status() === 403, `a purge sent by hand as read-only is refused (${byHand.status()})`);
  await view.goto(list({ queue: reports }));
  check((await view.locator(`tr[data-id="${someId}"]`).count()) === 1, "and the record is still there");
} finally {
  await browser.close();
}
console.log(`${label}: ${checks} checks passed; screenshots in ${shots}`);
