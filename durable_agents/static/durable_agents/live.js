/* The console's live refresh (the durable_live template tag): the page refetches itself every few seconds and
 * swaps the regions named in #durable-live's data-regions, so statuses, steps, effects and waits move without a
 * reload. It never works under the operator's hands: a focused or edited field, selected rows or selected text in
 * a region hold the swap. It stops when the tab is hidden, when the page shows a final state (data-final), and
 * for good on a sign-out or a 403; on errors it backs off and says since when the page is stale.
 * No framework, no inline script; the Pause toggle is remembered in localStorage for every console page.
 */
'use strict';
{
    const PAUSED_KEY = 'durable_agents.live.paused';
    const LONGEST_BACKOFF_MS = 60000;
    // Fields that hold no typing: a focused button or checkbox does not hold a swap (a checked box does).
    const NOT_TYPED = new Set(['button', 'submit', 'reset', 'image', 'hidden', 'checkbox', 'radio']);

    function twoDigits(number) {
        return String(number).padStart(2, '0');
    }

    function clockTime(date) {
        return [date.getHours(), date.getMinutes(), date.getSeconds()].map(twoDigits).join(':');
    }

    function agoText(then) {
        const seconds = Math.max(0, Math.round((Date.now() - then) / 1000));
        if (seconds < 60) {
            return seconds + ' s ago';
        }
        const minutes = Math.floor(seconds / 60);
        return minutes < 60 ? minutes + ' min ago' : 'at ' + clockTime(new Date(then));
    }

    function isTypedInto(element) {
        if (!element || element === document.body) {
            return false;
        }
        if (element.isContentEditable || element.matches('select, textarea')) {
            return true;
        }
        return element.matches('input') && !NOT_TYPED.has(element.type);
    }

    function isEdited(field) {
        if (field.matches('input[type=checkbox], input[type=radio]')) {
            return field.checked !== field.defaultChecked;
        }
        if (field.matches('select')) {
            const options = Array.from(field.options);
            if (field.multiple) {
                return options.some((option) => option.selected !== option.defaultSelected);
            }
            // A single select with no option marked selected shows its first: that is its unedited state.
            const marked = options.findIndex((option) => option.defaultSelected);
            return field.selectedIndex !== Math.max(marked, 0);
        }
        return isTypedInto(field) && field.value !== field.defaultValue;
    }

    /* Why a swap now would destroy what the operator is doing, or null. */
    function holdReason(regions) {
        if (document.querySelector('input.action-select:checked')) {
            return 'rows are selected';
        }
        const active = document.activeElement;
        if (isTypedInto(active) && regions.some((region) => region.contains(active))) {
            return 'a field has focus';
        }
        for (const region of regions) {
            for (const field of region.querySelectorAll('input, select, textarea')) {
                if (isEdited(field)) {
                    return 'a field has unsaved input';
                }
            }
        }
        const selection = window.getSelection();
        if (selection && !selection.isCollapsed && selection.rangeCount > 0) {
            const range = selection.getRangeAt(0);
            if (regions.some((region) => range.intersectsNode(region))) {
                return 'text is selected';
            }
        }
        return null;
    }

    /* Open <details> (a traceback, a transcript) stay open across a swap: keyed by the nearest id and the summary. */
    function detailsKey(details) {
        const anchor = details.parentElement && details.parentElement.closest('[id]');
        const summary = details.querySelector('summary');
        return (anchor ? anchor.id : '') + '|' + (summary ? summary.textContent.trim() : '');
    }

    function keepOpenDetails(region) {
        const open = new Set();
        region.querySelectorAll('details[open]').forEach((details) => open.add(detailsKey(details)));
        return open;
    }

    function reopenDetails(region, open) {
        if (open.size) {
            region.querySelectorAll('details').forEach((details) => {
                if (open.has(detailsKey(details))) {
                    details.open = true;
                }
            });
        }
    }

    function rowKeys(form) {
        return Array.from(form.querySelectorAll('tr input.action-select'), (box) => box.value).join(' ');
    }

    /* The run list's form: the same rows get their cells swapped around the checkboxes the admin's actions.js
     * is bound to; other rows replace the form, and actions.js is bound to the new checkboxes. */
    function swapChangelistForm(old, fresh) {
        const rows = Array.from(old.querySelectorAll('#result_list tbody tr'));
        const freshRows = Array.from(fresh.querySelectorAll('#result_list tbody tr'));
        const sameRows = rows.length > 0 && rows.length === freshRows.length && rowKeys(old) === rowKeys(fresh)
            && rows.every((row, index) => row.cells.length === freshRows[index].cells.length);
        if (sameRows) {
            rows.forEach((row, index) => {
                const freshCells = Array.from(freshRows[index].cells);
                Array.from(row.cells).forEach((cell, column) => {
                    if (!cell.querySelector('input.action-select')) {
                        cell.replaceWith(freshCells[column]);
                    }
                });
            });
            const paginator = old.querySelector('.paginator');
            const freshPaginator = fresh.querySelector('.paginator');
            if (paginator && freshPaginator) {
                paginator.replaceWith(freshPaginator);
            }
            const counter = old.querySelector('.action-counter');
            const freshCounter = fresh.querySelector('.action-counter');
            if (counter && freshCounter) {
                counter.dataset.actionsIcnt = freshCounter.dataset.actionsIcnt;
                counter.textContent = freshCounter.textContent;
            }
            return;
        }
        old.replaceWith(fresh);
        const boxes = document.querySelectorAll('tr input.action-select');
        if (window.Actions && boxes.length > 0) {
            bindActions(boxes);
        }
    }

    let actionListeners = [];

    /* Binds the admin's actions.js to new rows. Each Actions() call adds keydown, keyup and pageshow listeners to
     * document and window whose closures hold its checkboxes: the ones the previous binding added are removed
     * first, or each swap of new rows would keep the old table alive (a tab open all night would leak). */
    function bindActions(boxes) {
        actionListeners.forEach(([target, type, listener]) => target.removeEventListener(type, listener));
        actionListeners = [];
        const targets = [document, window];
        targets.forEach((target) => {
            const add = target.addEventListener;
            target.addEventListener = function(type, listener, options) {
                actionListeners.push([target, type, listener]);
                return add.call(this, type, listener, options);
            };
        });
        try {
            window.Actions(boxes);
        } finally {
            // The own property shadowed EventTarget.prototype's method: deleting it restores the original.
            targets.forEach((target) => delete target.addEventListener);
        }
    }

    const FOCUSABLE = 'a[href], button, input, select, textarea, summary, [tabindex]';

    /* A keyboard user's place (a link, a button, a summary) survives a swap: found again by the nearest id around
     * it (a step's row, an event's, a panel) and its position among the focusable elements inside. */
    function focusPlace(region) {
        const active = document.activeElement;
        if (!active || active === document.body || !region.contains(active)) {
            return null;
        }
        const anchor = active.closest('[id]');
        return {anchor: anchor.id, index: Array.from(anchor.querySelectorAll(FOCUSABLE)).indexOf(active)};
    }

    function refocus(region, place) {
        if (!place || region.contains(document.activeElement)) {
            return;
        }
        const anchor = document.getElementById(place.anchor);
        const element = anchor && (place.index < 0 ? anchor : anchor.querySelectorAll(FOCUSABLE)[place.index]);
        if (element && region.contains(element)) {
            element.focus({preventScroll: true});
        }
    }

    function swapRegion(old, fresh) {
        const open = keepOpenDetails(old);
        const place = focusPlace(old);
        if (old.id === 'changelist-form') {
            swapChangelistForm(old, fresh);
        } else {
            old.replaceWith(fresh);
        }
        const region = document.getElementById(old.id) || fresh;
        reopenDetails(region, open);
        refocus(region, place);
    }

    function isPaused() {
        try {
            return window.localStorage.getItem(PAUSED_KEY) === '1';
        } catch (error) {
            return false;
        }
    }

    function setPaused(paused) {
        try {
            if (paused) {
                window.localStorage.setItem(PAUSED_KEY, '1');
            } else {
                window.localStorage.removeItem(PAUSED_KEY);
            }
        } catch (error) {
            // Storage refused (a private window's quota): the toggle still works for this page.
        }
    }

    function start(indicator) {
        const interval = Number(indicator.dataset.intervalMs);
        const selectors = indicator.dataset.regions.split(',').map((selector) => selector.trim()).filter(Boolean);
        const text = indicator.querySelector('.durable-live-text');
        const toggle = indicator.querySelector('.durable-live-toggle');
        const live = {
            updated: Date.now(), due: Date.now() + interval, failures: 0, inFlight: false,
            held: null, stale: null, stopped: null, pausedHere: false, ticks: 0, polls: 0, timer: null,
        };
        const regions = () => selectors.map((selector) => document.querySelector(selector)).filter(Boolean);
        const paused = () => live.pausedHere || isPaused();

        function render() {
            let state = 'live';
            let words = 'Live · updated ' + agoText(live.updated);
            if (live.stopped) {
                state = 'stopped';
                words = live.stopped;
            } else if (paused()) {
                state = 'paused';
                words = 'Paused · updated ' + agoText(live.updated);
            } else if (live.stale) {
                state = 'stale';
                words = 'Not updated since ' + clockTime(new Date(live.updated)) + ' (' + live.stale + ')'
                    + ' · retrying in ' + Math.max(0, Math.ceil((live.due - Date.now()) / 1000)) + ' s';
            } else if (live.held) {
                state = 'held';
                words = 'Live · on hold while ' + live.held + ' · updated ' + agoText(live.updated);
            }
            indicator.dataset.state = state;
            indicator.dataset.ticks = String(live.ticks);
            indicator.dataset.polls = String(live.polls);
            text.textContent = words;
            toggle.textContent = state === 'paused' ? 'Resume' : 'Pause';
            toggle.hidden = state === 'stopped';
        }

        /* No more refreshes; `alarm`: the page went stale for good (signed out, refused), shown in red. */
        function stop(words, alarm = false) {
            live.stopped = words;
            indicator.classList.toggle('durable-live-alarm', alarm);
            window.clearInterval(live.timer);
            render();
        }

        function fail(reason) {
            live.failures += 1;
            live.stale = reason;
            const backoff = interval * 2 ** live.failures;
            live.due = Date.now() + Math.min(backoff, Math.max(LONGEST_BACKOFF_MS, interval));
        }

        async function refresh() {
            live.inFlight = true;
            try {
                let response;
                try {
                    response = await fetch(window.location.href, {
                        credentials: 'same-origin', cache: 'no-store', headers: {'X-Durable-Live': '1'},
                    });
                } catch (error) {
                    fail('server unreachable');
                    return;
                }
                if (response.status === 401 || response.status === 403) {
                    stop('Live updates stopped: access refused (' + response.status + '); reload the page', true);
                    return;
                }
                if (response.status === 404) {
                    stop('Live updates stopped: this page no longer exists (deleted meanwhile)', true);
                    return;
                }
                if (!response.ok) {
                    fail('server error ' + response.status);
                    return;
                }
                const page = new DOMParser().parseFromString(await response.text(), 'text/html');
                if (response.redirected) {
                    const signedOut = page.getElementById('login-form') || /\/login\//.test(new URL(response.url).pathname);
                    stop(signedOut
                        ? 'Live updates stopped: signed out; reload the page to sign in'
                        : 'Live updates stopped: the page moved; reload it', true);
                    return;
                }
                // The operator may have paused, or started typing or selecting, while the page was on its way.
                const current = regions();
                live.held = holdReason(current);
                if (live.held || paused()) {
                    return;
                }
                const pairs = current.map((old) => [old, old.id && page.getElementById(old.id)]);
                if (!pairs.some(([, fresh]) => fresh)) {
                    // A 200 that is not this page (a proxy's maintenance page): stale, not "updated".
                    fail('the server answered with another page');
                    return;
                }
                for (const [old, fresh] of pairs) {
                    if (fresh) {
                        swapRegion(old, document.adoptNode(fresh));
                    }
                }
                live.updated = Date.now();
                live.due = live.updated + interval;
                live.failures = 0;
                live.stale = null;
                live.polls += 1;
                const freshIndicator = page.getElementById('durable-live');
                if (freshIndicator && freshIndicator.hasAttribute('data-final')) {
                    stop('Final state · live updates stopped');
                }
            } catch (error) {
                fail('unreadable answer');
            } finally {
                live.inFlight = false;
                if (!live.stopped) {
                    render();
                }
            }
        }

        function tick() {
            live.ticks += 1;
            const due = Date.now() >= live.due;
            if (due && !live.inFlight && !live.stopped && !paused() && document.visibilityState === 'visible') {
                live.held = holdReason(regions());
                if (!live.held) {
                    refresh();
                }
            }
            render();
        }

        toggle.addEventListener('click', () => {
            const resume = paused();
            live.pausedHere = false;
            setPaused(!resume);
            live.pausedHere = !resume && !isPaused();
            if (resume) {
                live.due = Date.now();
            }
            render();
        });
        document.addEventListener('visibilitychange', () => {
            // Back on the tab: refresh now, unless the server is being given time after an error.
            if (document.visibilityState === 'visible' && !live.stale) {
                live.due = Date.now();
            }
        });

        indicator.hidden = false;
        if (indicator.hasAttribute('data-final')) {
            stop('Final state · live updates off');
            return;
        }
        render();
        live.timer = window.setInterval(tick, Math.min(1000, Math.max(100, interval)));
    }

    function ready(fn) {
        if (document.readyState !== 'loading') {
            fn();
        } else {
            document.addEventListener('DOMContentLoaded', fn);
        }
    }

    ready(() => {
        const indicator = document.getElementById('durable-live');
        if (indicator && Number(indicator.dataset.intervalMs) > 0) {
            start(indicator);
        }
    });
}
