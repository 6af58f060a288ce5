// Many VUs on one session whose cap is 100 upstream calls: exactly 100 get through,
// the rest are refused with 402 before any upstream call.
import http from 'k6/http';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import { BACKSTOP, MOCK, chat } from './lib.js';

const CAP = parseInt(__ENV.CAP || '100', 10);
const admitted = new Counter('admitted');
const refused = new Counter('refused');

export const options = {
  scenarios: {
    race: { executor: 'shared-iterations', vus: 50, iterations: CAP * 4, maxDuration: '60s' },
  },
  thresholds: {
    admitted: [`count==${CAP}`],
    refused: [`count==${CAP * 3}`],
    checks: ['rate==1'],
  },
};

export function setup() {
  return { session: `race-${Date.now()}` };
}

export default function (data) {
  const res = http.post(`${BACKSTOP}/v1/chat/completions`, chat(), {
    headers: { 'content-type': 'application/json', authorization: 'Bearer bk-race-test-key', 'x-session-id': data.session, 'x-mock-scenario': data.session },
  });
  if (res.status === 200) admitted.add(1);
  if (res.status === 402) refused.add(1);
  check(res, { '200 or 402 budget_exceeded': (r) => r.status === 200 || (r.status === 402 && r.json('error.code') === 'budget_exceeded') });
}

export function teardown(data) {
  const stats = http.get(`${MOCK}/mock/stats`).json();
  check(stats, { 'the upstream saw exactly the cap': (s) => s.scenarios[data.session] === CAP });
}
