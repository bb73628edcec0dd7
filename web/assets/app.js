// jobrail-web: the only script. The pages work without it.
document.addEventListener("DOMContentLoaded", () => {
  // "Select every row of this page".
  for (const all of document.querySelectorAll("[data-select-all]")) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll("input[name=id][type=checkbox]")) box.checked = all.checked;
    });
  }
  // The overview refreshes itself while the tab is visible.
  const refresh = document.querySelector("[data-refresh]");
  if (refresh) {
    const seconds = Number(refresh.getAttribute("data-refresh")) || 10;
    setInterval(() => { if (document.visibilityState === "visible") location.reload(); }, seconds * 1000);
  }
});
