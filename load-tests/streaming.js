// Time to first chunk of a stream (k6's http_req_waiting), through Backstop and direct
// to the mock in the same run.
import http from 'k6/http';
import { check } from 'k6';
import { BACKSTOP, MOCK, DURATION, RATE, chat, headers, latency } from './lib.js';

const rate = Math.max(10, Math.floor(RATE / 4));

export const options = {
  scenarios: {
    through: { executor: 'constant-arrival-rate', rate, timeUnit: '1s', duration: DURATION, preAllocatedVUs: 20, maxVUs: 200, env: { TARGET: 'backstop' }, tags: { target: 'backstop' } },
    direct: { executor: 'constant-arrival-rate', rate, timeUnit: '1s', duration: DURATION, preAllocatedVUs: 20, maxVUs: 200, env: { TARGET: 'direct' }, tags: { target: 'direct' } },
  },
  thresholds: Object.assign({
    checks: ['rate>0.999'],
  }, latency({ 'http_req_waiting{target:backstop}': ['p(95)<20'], 'http_req_waiting{target:direct}': ['p(95)<20'] })),
};

export default function () {
  const base = __ENV.TARGET === 'direct' ? MOCK : BACKSTOP;
  const res = http.post(`${base}/v1/chat/completions`, chat({ stream: true }), { headers: headers({ 'x-mock-fault': 'chunks=8' }) });
  check(res, {
    'status 200': (r) => r.status === 200,
    'a whole SSE stream': (r) => r.body.includes('data: [DONE]'),
  });
}
